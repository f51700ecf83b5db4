"""When a run ends early: a stop signal (SIGTERM/SIGINT), or a wall-clock budget that also sets the step count."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gptforge.config import Config
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_sum, broadcast_int, print0, waiting_in

# A time budget plans the step count once PLAN_AFTER steps of a command ran (the first one, which pays for warm-up,
# is not paced), each step until CALIBRATION_STEPS, then every REPLAN_EVERY steps from the last PACE_WINDOW steps'
# pace; a plan that moved more than DRIFT from the last one said is said again.
PLAN_AFTER, CALIBRATION_STEPS, REPLAN_EVERY, PACE_WINDOW, DRIFT = 2, 25, 10, 20, 0.05
# The first and the final evaluation may take EVAL_SHARE of a time budget together: on a slow host they score fewer
# validation tokens (the periodic ones, as many, are planned for like the steps).
EVAL_SHARE = 0.25
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
        self.last_saved: Callable[[], Path | None] = lambda: None
        """The newest checkpoint a resume would start from (the run's checkpointer sets it), for a second signal."""
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
        if self.received is not None:  # a second signal: the step (a long sample or evaluation) is not waited for
            saved = self.last_saved()
            kept = f"the last one saved, {saved}, is kept" if saved else "none was saved yet"
            print(
                f"gptforge train: error: a second {signal.Signals(signum).name}: stopping now, without a checkpoint "
                f"({kept})",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signum)
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
        # Let go of the run's checkpointer now: kept until the process group was destroyed, its objects' C++
        # threads aborted the process at exit ("terminate called without an active exception") under torchrun.
        self.last_saved = lambda: None
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


def evaluation_seconds(cfg: Config) -> float:
    """What the first evaluation (and the final one) may take under a time budget: half of EVAL_SHARE of it."""
    return cfg.train.time_budget * EVAL_SHARE / 2


@dataclass
class Vote:
    """What every rank does after a step: stop now (any rank's signal), or make the next step the last (no time)."""

    signal: bool
    out_of_time: bool


class TimeBudget:
    """`train.time_budget` seconds for the whole run, evaluations, checkpoints and earlier commands of a resumed run
    included (0: none), kept to within about one step. The step count is planned from the steps' recent pace after
    the first paced step and again as the pace drifts; whatever the plans, the last step is the schedule's last (a
    run out of time takes one more, the last), so its decay ends on time. Rank 0's clock decides for every rank."""

    def __init__(self, cfg: Config, has_val: bool, env: DistEnv, device: torch.device, first_step: int = 0) -> None:
        self.seconds, self.env, self.device = cfg.train.time_budget, env, device
        self.ceiling, self.warmup = cfg.train.max_steps, cfg.optim.warmup_steps
        self.eval_every = cfg.eval.every if has_val else 0
        self.save_every = cfg.checkpoint.every
        self.first_step = first_step
        self.eval_seconds = 0.0
        """What one evaluation costs: each `eval_every` steps, and once more at the end (the latest one's time)."""
        self.save_seconds = 0.0
        """What one checkpoint costs: each `save_every` steps, and once more at the end."""
        self._paces: list[float] = []  # seconds of each recent step, evaluations and checkpoints left out
        self._mark: float | None = None
        self._extra = 0.0  # evaluation and checkpoint seconds since the mark
        self._said: int | None = None

    def calibrating(self, step: int) -> bool:
        """No step count planned yet (the first steps of a command pay for warm-up: allocator, compilation)."""
        return self.seconds > 0 and step < self.first_step + PLAN_AFTER

    def planned_now(self, step: int) -> bool:
        """Whether `step` is the one after which the step count was first planned."""
        return self.seconds > 0 and step == self.first_step + PLAN_AFTER

    @property
    def per_step(self) -> float:
        """A step's seconds at the recent pace (0: none paced yet): a slowdown counts at once, a speed-up once the
        window holds it."""
        if not self._paces:
            return 0.0
        recent = self._paces[-REPLAN_EVERY:]
        return max(sum(self._paces) / len(self._paces), sum(recent) / len(recent))

    def plan(self, step: int, max_steps: int, now: float, elapsed: float) -> int:
        """The step count that ends the run on time at the recent pace (`elapsed`: the run's seconds so far),
        planned each step at first and every REPLAN_EVERY steps after; said when it moves by more than DRIFT.
        Never `step` or fewer (the step just taken had an earlier plan's learning rate), nor past a finished one."""
        if self.seconds <= 0:
            return max_steps
        if self._mark is not None:  # the command's first step pays for warm-up: it has no mark before it
            self._paces = [*self._paces, now - self._mark - self._extra][-PACE_WINDOW:]
        self._mark, self._extra = now, 0.0
        since = step - self.first_step
        if step >= max_steps or since < PLAN_AFTER or (since >= CALIBRATION_STEPS and since % REPLAN_EVERY):
            return max_steps
        per_step = self.per_step
        left = self.seconds - elapsed - self.eval_seconds - self.save_seconds  # the final evaluation and save
        fitted = broadcast_int(self._fit(step, left, per_step), self.env, self.device)
        if self._said is None or abs(fitted - self._said) > DRIFT * self._said:
            again = "" if self._said is None else f" (was {self._said}: the pace changed)"
            print0(self.env, f"time budget {self.seconds:.0f}s: {per_step:.2f}s/step -> {fitted} steps{again}")
            if self._said is None and fitted <= self.warmup:
                print0(self.env, self._too_short(fitted, per_step))
            self._said = fitted
        return fitted

    def _fit(self, step: int, left: float, per_step: float) -> int:
        """The last step that ends within `left` seconds with the evaluations and checkpoints due before it (this
        step's own included: they run after the plan); at least the next step."""

        def cost(last: int) -> float:
            due = [(last - 1) // n - (step - 1) // n if n else 0 for n in (self.eval_every, self.save_every)]
            return (last - step) * per_step + due[0] * self.eval_seconds + due[1] * self.save_seconds

        low, high = step + 1, self.ceiling  # cost grows with the step count: bisect for the last that fits
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if cost(middle) <= left else (low, middle - 1)
        return low

    def _too_short(self, fitted: int, per_step: float) -> str:
        need = (self.warmup * 4) * per_step + self.eval_seconds
        return (
            f"warning: only {fitted} steps fit in train.time_budget={self.seconds:.0f}, not past the learning rate's "
            f"{self.warmup}-step warm-up: the model will barely train (about {need:.0f}s would give 4x the warm-up)"
        )

    def expect_evaluation(self, seconds: float) -> None:
        """An evaluation is expected to take `seconds` (the plan reserves them for the final one until one ran)."""
        self.eval_seconds = seconds

    def evaluated(self, seconds: float) -> None:
        """An evaluation took `seconds` (kept out of the steps' pace; the next ones are planned to cost as much)."""
        self.eval_seconds = seconds
        self._extra += seconds

    def saved(self, seconds: float) -> None:
        """A checkpoint took `seconds` (kept out of the steps' pace; the next ones are planned to cost as much)."""
        self.save_seconds = seconds
        self._extra += seconds

    def stop_vote(self, stop: StopSignal, elapsed: float) -> Vote:
        """What every rank does after this step: stop on any rank's signal; make the next step the last when rank 0
        has time for it alone, with the final evaluation and save (`elapsed`: the run's seconds so far)."""
        # The next step and one more, then the final evaluation and save: without room for both steps, the next one
        # is the last, and runs at the schedule's last learning rate.
        after_next = elapsed + 2 * self.per_step + self.eval_seconds + self.save_seconds
        out_of_time = self.seconds > 0 and after_next > self.seconds and self.env.is_main
        votes = torch.tensor([stop.received is not None, out_of_time], dtype=torch.long, device=self.device)
        if self.env.distributed:
            all_reduce_sum(votes, self.env)
        return Vote(signal=bool(votes[0]), out_of_time=bool(votes[1]))

    def last_step(self, step: int, max_steps: int) -> int:
        """The step count once out of time after `step`: one more step, the schedule's last (said)."""
        if step + 1 < max_steps:
            print0(
                self.env, f"time budget {self.seconds:.0f}s: out of time, step {step + 1} is the last (was {max_steps})"
            )
            self._said = step + 1
        return min(max_steps, step + 1)
