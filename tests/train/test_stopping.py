"""The time budget on a fake clock: the step count it fits, and the stop vote; what counts as blocked."""

import threading
import time

import torch

from gptforge.config import load_config
from gptforge.runtime.distributed import SINGLE
from gptforge.train.stopping import PLAN_AFTER, StopSignal, TimeBudget, _blocked_stack


def budget(seconds, eval_every=0, has_val=True, max_steps=100_000, first_step=0):
    cfg = load_config(
        "tiny", [f"train.time_budget={seconds}", f"eval.every={eval_every}", f"train.max_steps={max_steps}"]
    )
    return TimeBudget(cfg, has_val, SINGLE, torch.device("cpu"), first_step=first_step)


def drive(b, pace, eval_seconds=0.0, step=0, spent=0.0):
    """Run steps as the trainer does on a fake clock: step i costs pace(i, now) seconds, an evaluation
    eval_seconds (each eval_every steps, and at the end); returns (steps, seconds at the end, stopped on time)."""
    now, max_steps = spent, 100_000
    b.evaluated(eval_seconds) if step == 0 else None
    now += eval_seconds if step == 0 else 0.0
    while step < max_steps:
        now += pace(step, now)
        step += 1
        max_steps = b.plan(step, max_steps, now=now, elapsed=now)
        if b.stop_vote(StopSignal(), elapsed=now):
            return step, now + eval_seconds, True
        if b.eval_every and step % b.eval_every == 0 and step < max_steps:
            now += eval_seconds
            b.evaluated(eval_seconds)
    return step, now + eval_seconds, False


def test_steps_are_planned_after_the_first_paced_step():
    b = budget(100)
    assert b.calibrating(1) and not b.calibrating(PLAN_AFTER)
    assert b.plan(1, 100_000, now=5.0, elapsed=5.0) == 100_000  # the first step pays for warm-up: not paced
    # 1 s/step since, 94 s left at 6 s -> 94 more steps.
    assert b.plan(2, 100_000, now=6.0, elapsed=6.0) == 2 + 94
    assert budget(0).plan(2, 40, now=1e9, elapsed=1e9) == 40 and not budget(0).calibrating(0)
    capped = budget(100, max_steps=40)
    capped.plan(1, 40, now=5.0, elapsed=5.0)
    assert capped.plan(2, 40, now=6.0, elapsed=6.0) == 40  # train.max_steps is a ceiling


def test_a_clock_that_slows_down_halfway_still_ends_the_schedule_on_time():
    # 1 s a step, 2 s from 50 s on: a count fixed at the start (100 steps) would be stopped at step 75 of 100,
    # before its decay; planned again as the pace drifts, the schedule ends within the budget.
    steps, seconds, cut = drive(budget(100), lambda i, now: 1.0 if now < 50 else 2.0)
    assert not cut and seconds <= 100 and steps >= 70
    # Slow first, fast later: the count grows to use the time, still ending on time.
    steps, seconds, cut = drive(budget(100), lambda i, now: 2.0 if now < 50 else 1.0)
    assert not cut and 95 <= seconds <= 100 and steps >= 70


def test_evaluations_are_planned_for_and_kept_out_of_the_pace():
    b = budget(100, eval_every=10)
    steps, seconds, cut = drive(b, lambda i, now: 1.0, eval_seconds=5.0)
    assert not cut and 95 <= seconds <= 100
    # 1 s per step and 5 s per 10 steps, the first and final evaluations too: 60 steps (and 5 evaluations).
    assert steps == 60


def test_a_resume_inside_the_first_steps_plans_from_its_own_pace():
    b = budget(100, first_step=10)
    assert b.plan(11, 100_000, now=41.0, elapsed=41.0) == 100_000
    assert b.plan(12, 100_000, now=42.0, elapsed=42.0) == 12 + 58  # 40 s spent before it, 1 s/step now
    steps, seconds, cut = drive(budget(100, first_step=10), lambda i, now: 1.0, step=10, spent=40.0)
    assert not cut and seconds <= 100 and steps == 70


def test_a_budget_too_short_to_leave_the_warm_up_says_so(capsys):
    cfg_warmup = budget(100).warmup
    drive(budget(cfg_warmup * 0.5), lambda i, now: 1.0)
    out = capsys.readouterr().out
    assert "the model will barely train" in out and f"{cfg_warmup}-step warm-up" in out
    drive(budget(cfg_warmup * 10), lambda i, now: 1.0)
    assert "barely train" not in capsys.readouterr().out


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
