"""When a run ends early: a stop signal (SIGTERM/SIGINT), or a wall-clock budget that also sets the step count."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback

import torch

from gptforge.config import Config
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_sum, broadcast_int, print0, waiting_in

# A time budget fixes the step count from the pace of steps CALIBRATION_START..CALIBRATION_END
# (the first steps pay for warm-up: allocator, compilation).
CALIBRATION_START, CALIBRATION_END = 5, 25
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A training step returns to Python every few milliseconds; a main thread this long in one native call when a stop
# signal comes is waiting on a peer rank that stopped responding, and would not reach the stop vote.
BLOCKED_SECONDS = 10.0


class StopSignal:
    """SIGTERM/SIGINT request a checkpoint and a clean exit at the end of the current step; in a distributed run, a
    signal that finds this rank blocked (BLOCKED_SECONDS in one native call) ends the process at once instead."""

    def __init__(self, env: DistEnv = SINGLE) -> None:
        self.received: int | None = None
        self.env = env
        self._previous = {}
        self._wakeup: int | None = None

    def __enter__(self) -> StopSignal:
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        if self.env.distributed and self._previous:
            # Python runs the handler between bytecodes, never while a collective waits; the wakeup fd gets the
            # signal's number at once, so a thread reading it sees the signal even then.
            read, self._wakeup = os.pipe()
            os.set_blocking(self._wakeup, False)
            self._previous_wakeup = signal.set_wakeup_fd(self._wakeup)
            threading.Thread(target=self._watch, args=(read,), name="stop-signal", daemon=True).start()
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def _watch(self, read: int) -> None:
        """Exit with 128 + the signal's number, and one line saying where, when a signal finds the rank blocked."""
        while data := os.read(read, 64):  # b"" once __exit__ closes the write end
            signum = next((s for s in data if s in STOP_SIGNALS), None)
            stack = _blocked_stack(BLOCKED_SECONDS) if signum else None
            if stack:
                name, where = signal.Signals(signum).name, waiting_in(stack)
                print(
                    f"gptforge train: error: rank {self.env.rank}: {name}, and {where} has not returned for "
                    f"{BLOCKED_SECONDS:g}s (a peer rank stopped responding?): exiting without a checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(128 + signum)
        os.close(read)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._wakeup)


def _blocked_stack(seconds: float) -> traceback.StackSummary | None:
    """The main thread's stack if it stays `seconds` in one call (the same frame at the same instruction), else None."""
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main)  # the same object for as long as that frame runs
    if frame is None:  # the interpreter is shutting down
        return None
    position = frame.f_lasti
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = sys._current_frames().get(main)
        if now is not frame or now.f_lasti != position:
            return None
    return traceback.extract_stack(frame)


class TimeBudget:
    """`train.time_budget` seconds for the whole run (0: none); rank 0's clock decides for every rank."""

    def __init__(self, cfg: Config, has_val: bool, env: DistEnv, device: torch.device) -> None:
        self.seconds, self.env, self.device = cfg.train.time_budget, env, device
        self.eval_every = cfg.eval.every if has_val else 0
        self._t_calibrate: float | None = None
        self._eval_total = self._eval_at_calibrate = 0.0  # evaluation seconds so far, and when calibration began
        self._evals = self._evals_at_calibrate = 0
        self.eval_seconds = 0.0
        """What one evaluation costs: each `eval_every` steps, and once more at the end. The first one's time
        until evaluations inside the calibration window say better (the first also pays one-time warm-up: 1 s on
        a GPU whose evaluations then take 0.1 s)."""

    def calibrating(self, step: int) -> bool:
        return self.seconds > 0 and step < CALIBRATION_END

    def fit_steps(self, step: int, max_steps: int, now: float, elapsed: float) -> int:
        """The step count, fixed once at CALIBRATION_END from the pace of the steps since CALIBRATION_START
        (plus the evaluations' share) so that the run, its schedule included, ends on time."""
        if self.seconds <= 0:
            return max_steps
        if step == CALIBRATION_START:
            self._t_calibrate, self._eval_at_calibrate, self._evals_at_calibrate = now, self._eval_total, self._evals
        elif step == CALIBRATION_END and self._t_calibrate is not None:
            # The steps' own pace: evaluations inside the window are planned for separately below.
            window_evals = self._evals - self._evals_at_calibrate
            window_eval_seconds = self._eval_total - self._eval_at_calibrate
            if window_evals:
                self.eval_seconds = window_eval_seconds / window_evals
            per_step = (now - self._t_calibrate - window_eval_seconds) / (CALIBRATION_END - CALIBRATION_START)
            if self.eval_every:
                per_step += self.eval_seconds / self.eval_every
            left = self.seconds - elapsed - self.eval_seconds
            fitted = max(step, min(max_steps, step + int(left / per_step)))
            max_steps = broadcast_int(fitted, self.env, self.device)
            print0(self.env, f"time budget {self.seconds:.0f}s: {per_step:.2f}s/step -> {max_steps} steps")
        return max_steps

    def evaluated(self, seconds: float) -> None:
        """An evaluation during the loop took `seconds` (kept out of the steps' measured pace)."""
        self._eval_total += seconds
        self._evals += 1

    def stop_vote(self, stop: StopSignal, elapsed: float) -> str | None:
        """Why every rank should stop after this step, or None: any rank's signal, or rank 0 out of time."""
        out_of_time = self.seconds > 0 and elapsed > self.seconds and self.env.is_main
        votes = torch.tensor([stop.received is not None, out_of_time], dtype=torch.long, device=self.device)
        if self.env.distributed:
            all_reduce_sum(votes, self.env)
        if votes[0]:
            return "a stop signal"
        if votes[1]:
            return f"the time budget of {self.seconds:.0f}s"
        return None
