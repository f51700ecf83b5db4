"""The time budget on a fake clock: the step count it fits, and the stop vote; what counts as blocked."""

import threading
import time

import torch

from gptforge.config import load_config
from gptforge.runtime.distributed import SINGLE
from gptforge.train.stopping import CALIBRATION_END, CALIBRATION_START, StopSignal, TimeBudget, _blocked_stack


def budget(seconds, eval_every=0, has_val=True):
    cfg = load_config("tiny", [f"train.time_budget={seconds}", f"eval.every={eval_every}"])
    return TimeBudget(cfg, has_val, SINGLE, torch.device("cpu"))


def test_steps_are_fitted_from_the_calibration_pace():
    b = budget(100)
    assert b.calibrating(0) and b.calibrating(CALIBRATION_END - 1) and not b.calibrating(CALIBRATION_END)
    assert b.fit_steps(CALIBRATION_START, 10_000, now=10.0, elapsed=10.0) == 10_000
    # 20 steps in 20 s: 1 s/step, 70 s left at 30 s elapsed -> 70 more steps.
    assert b.fit_steps(CALIBRATION_END, 10_000, now=30.0, elapsed=30.0) == CALIBRATION_END + 70
    assert b.fit_steps(CALIBRATION_END + 1, 95, now=31.0, elapsed=31.0) == 95  # fixed once


def test_evaluations_are_planned_for_and_max_steps_is_a_ceiling():
    b = budget(100, eval_every=10)
    b.eval_seconds = 5.0  # 1 + 5/10 s per step; the final evaluation's 5 s reserved
    b.fit_steps(CALIBRATION_START, 10_000, now=10.0, elapsed=10.0)
    assert b.fit_steps(CALIBRATION_END, 10_000, now=30.0, elapsed=30.0) == CALIBRATION_END + int(65 / 1.5)
    # Evaluations inside the calibration window are not part of the steps' pace: 4 of 5 s each there.
    inside = budget(100, eval_every=5)
    inside.eval_seconds = 5.0
    inside.fit_steps(CALIBRATION_START, 10_000, now=10.0, elapsed=10.0)
    for _ in range(4):
        inside.evaluated(5.0)
    assert inside.fit_steps(CALIBRATION_END, 10_000, now=50.0, elapsed=50.0) == CALIBRATION_END + int(45 / 2.0)
    # A first evaluation slowed by one-time warm-up (as on a GPU): the window's evaluations set the plan instead.
    warm = budget(100, eval_every=5)
    warm.eval_seconds = 10.0
    warm.fit_steps(CALIBRATION_START, 10_000, now=10.0, elapsed=10.0)
    for _ in range(4):
        warm.evaluated(0.5)
    assert warm.fit_steps(CALIBRATION_END, 10_000, now=32.0, elapsed=32.0) == CALIBRATION_END + int(67.5 / 1.1)
    assert warm.eval_seconds == 0.5
    short = budget(100)
    short.fit_steps(CALIBRATION_START, 40, now=10.0, elapsed=10.0)
    assert short.fit_steps(CALIBRATION_END, 40, now=30.0, elapsed=30.0) == 40
    none = budget(0)
    assert none.fit_steps(CALIBRATION_END, 40, now=1e9, elapsed=1e9) == 40 and not none.calibrating(0)


def test_stop_vote_on_time_and_on_a_signal():
    b, stop = budget(100), StopSignal()
    assert b.stop_vote(stop, elapsed=99.0) is None
    assert b.stop_vote(stop, elapsed=101.0) == "the time budget of 100s"
    stop.received = 15
    assert b.stop_vote(stop, elapsed=1.0) == "a stop signal"
    assert budget(0).stop_vote(StopSignal(), elapsed=1e9) is None


def test_a_main_thread_in_one_native_call_is_blocked_and_one_running_python_is_not():
    name = "test_a_main_thread_in_one_native_call_is_blocked_and_one_running_python_is_not"
    held = threading.Lock()
    held.acquire()

    def sample_then_release():
        # Until the main thread is inside its acquire below (it may still be starting this thread), it is not in one
        # native call of this function: sample again. A generous bound, run out only if blocked calls go unseen.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found.append(_blocked_stack(0.3))
            if found[-1] is not None and found[-1][-1].name == name:
                break
        held.release()

    found = []
    watcher = threading.Thread(target=sample_then_release)
    watcher.start()
    held.acquire()  # one native call, until the watcher has sampled: no sleep to outlast on a loaded machine
    watcher.join()
    assert found[-1] is not None and found[-1][-1].name == name

    def step():  # like a training step: Python calling native ops
        return torch.ones(64, 64) @ torch.ones(64, 64)

    def sample():
        found.extend(_blocked_stack(0.3) for _ in range(5))

    found = []
    watcher = threading.Thread(target=sample)
    watcher.start()
    while watcher.is_alive():
        step()
    # One sample may find the main thread descheduled by a loaded machine; not all five in a row, in practice.
    assert None in found
