"""When a run ends early: a stop signal (SIGTERM/SIGINT), or a wall-clock budget that also sets the step count."""

from __future__ import annotations

import contextlib
import signal

import torch

from gptforge.config import Config
from gptforge.runtime.distributed import DistEnv, all_reduce_sum, broadcast_int, print0

# A time budget fixes the step count from the pace of steps CALIBRATION_START..CALIBRATION_END
# (the first steps pay for warm-up: allocator, compilation).
CALIBRATION_START, CALIBRATION_END = 5, 25


class StopSignal:
    """SIGTERM/SIGINT request a checkpoint and a clean exit at the end of the current step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class TimeBudget:
    """`train.time_budget` seconds for the whole run (0: none); rank 0's clock decides for every rank."""

    def __init__(self, cfg: Config, has_val: bool, env: DistEnv, device: torch.device) -> None:
        self.seconds, self.env, self.device = cfg.train.time_budget, env, device
        self.eval_every = cfg.eval.every if has_val else 0
        self._t_calibrate: float | None = None
        self.eval_seconds = 0.0
        """What one evaluation costs: each `eval_every` steps, and once more at the end."""

    def calibrating(self, step: int) -> bool:
        return self.seconds > 0 and step < CALIBRATION_END

    def fit_steps(self, step: int, max_steps: int, now: float, elapsed: float) -> int:
        """The step count, fixed once at CALIBRATION_END from the pace of the steps since CALIBRATION_START
        (plus the evaluations' share) so that the run, its schedule included, ends on time."""
        if self.seconds <= 0:
            return max_steps
        if step == CALIBRATION_START:
            self._t_calibrate = now
        elif step == CALIBRATION_END and self._t_calibrate is not None:
            per_step = (now - self._t_calibrate) / (CALIBRATION_END - CALIBRATION_START)
            if self.eval_every:
                per_step += self.eval_seconds / self.eval_every
            left = self.seconds - elapsed - self.eval_seconds
            fitted = max(step, min(max_steps, step + int(left / per_step)))
            max_steps = broadcast_int(fitted, self.env, self.device)
            print0(self.env, f"time budget {self.seconds:.0f}s: {per_step:.2f}s/step -> {max_steps} steps")
        return max_steps

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
