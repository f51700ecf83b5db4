"""The training loop: GPT-3 recipe (AdamW, warm-up + cosine, accumulation, clipping), eval, checkpoints, logs.

One process, or one per device under torchrun (DDP: gradients sync on the last micro-step only). Every rank
runs this same loop; only rank 0 prints, logs and writes checkpoints (each rank adds its RNG state).
The pieces it calls: `setup` (config -> model, optimizer, ...), `step` (one optimizer step), `state` (the
counters a checkpoint keeps), `evaluator`, `checkpointer`, `stopping` (signals, time budget), `metrics`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gptforge.config import Config, to_dict, to_toml
from gptforge.data.loader import TokenLoader
from gptforge.data.mixture import MixtureLoader
from gptforge.data.prefetch import Prefetcher
from gptforge.files import atomic_write
from gptforge.outputs import locked, output_folder
from gptforge.rundir import CONFIG, METRICS, format_duration
from gptforge.runtime import distributed
from gptforge.runtime.device import resolve_device
from gptforge.runtime.flops import Utilisation, format_mfu
from gptforge.train.checkpointer import Checkpointer, find_resume
from gptforge.train.claim import claim_run_dir
from gptforge.train.evaluator import Evaluator, fit_evaluations
from gptforge.train.metrics import MetricsLog, NullLog
from gptforge.train.optim import set_lr
from gptforge.train.setup import (
    TrainSetup,
    build,
    open_data,
    resolve_config,
    resolve_precision,
    run_header,
    train_loader,
)
from gptforge.train.state import TrainState, ramp_accumulation
from gptforge.train.step import train_step
from gptforge.train.stopping import StopSignal, TimeBudget, evaluation_seconds


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    tokens: int
    seconds: float
    first_val: dict[str, float] | None
    last_val: dict[str, float] | None
    config: Config
    """The resolved config the run trained with (the data's vocabulary, init_from's architecture)."""


def train(cfg: Config, run_dir: str | Path, resume: str | None = None) -> TrainResult:
    """Train with `cfg` into RUN_DIR; under torchrun each process calls this."""
    env, device_name = distributed.init(cfg.train.device, cfg.train.dist_timeout)
    try:
        with (
            distributed.peer_failures(env, cfg.train.dist_timeout),
            StopSignal(env) as stop,
            contextlib.ExitStack() as cleanup,
        ):
            return _train(
                cfg,
                output_folder(run_dir),  # '' is no folder (Path('') would be the current one)
                resume=resume,
                env=env,
                device=resolve_device(device_name),
                stop=stop,
                cleanup=cleanup,
            )
    finally:
        distributed.cleanup()


def _train(
    cfg: Config,
    run_dir: Path,
    *,
    resume: str | None,
    env: distributed.DistEnv,
    device: torch.device,
    stop: StopSignal,
    cleanup: contextlib.ExitStack,
) -> TrainResult:
    t_start = time.perf_counter()
    run = _set_up(cfg, run_dir, resume=resume, env=env, device=device, cleanup=cleanup, t_start=t_start)
    if isinstance(run, TrainResult):  # a resumed run with nothing left to train
        return run
    state, checkpointer = run.state, run.checkpointer
    stop.last_saved = lambda: checkpointer.last_good
    first_val = last_val = _evaluate(run) if state.step == 0 else None
    run.t_loop = time.perf_counter()
    run.s.model.train()
    # Batches are read ahead on a thread; `batches.state_dict()` is the position after the last one trained on.
    batches = cleanup.enter_context(Prefetcher(run.loader, pin_memory=device.type == "cuda"))
    while state.step < state.max_steps:
        _report(run, batches, _step(run, batches))
        if state.step < state.max_steps and run.evaluate.due(state.step):
            last_val = _evaluate(run)
        if state.step < state.max_steps and checkpointer.due(state.step):
            checkpointer.save(state, batches, background=True)
            run.budget.saved(checkpointer.seconds)
        if _stop_now(run, stop):
            break

    last_val = run.evaluate(state.step) or last_val
    final = checkpointer.save(state, batches)
    seconds = time.perf_counter() - t_start
    run.print0(f"done: {state.step} steps, {state.tokens:,} tokens in {format_duration(seconds)}; saved {final}")
    return TrainResult(run_dir, final, state.step, state.tokens, seconds, first_val, last_val, run.cfg)


@dataclass
class _Run:
    """What the loop works with, built once by `_set_up`."""

    cfg: Config
    env: distributed.DistEnv
    s: TrainSetup
    loader: TokenLoader | MixtureLoader
    state: TrainState
    checkpointer: Checkpointer
    metrics: MetricsLog | NullLog
    evaluate: Evaluator
    budget: TimeBudget
    utilisation: Utilisation
    t_start: float
    """When this command started (perf_counter)."""
    spent: float
    """Seconds the run's earlier commands took: a time budget is the run's."""
    step_loop: int
    """The step this command's loop started from; `t_loop`, when (the console's pace counts from there)."""
    t_loop: float = 0.0

    def print0(self, text: str) -> None:
        distributed.print0(self.env, text)


def _set_up(
    cfg: Config,
    run_dir: Path,
    *,
    resume: str | None,
    env: distributed.DistEnv,
    device: torch.device,
    cleanup: contextlib.ExitStack,
    t_start: float,
) -> _Run | TrainResult:
    """The data, resolved config, model, checkpointer (restored on resume), log, evaluator and time budget; or the
    result of a resumed run with nothing left to train."""
    print0 = functools.partial(distributed.print0, env)
    data = open_data(cfg)
    resume_from = find_resume(run_dir, resume)
    cfg, init_weights = resolve_config(cfg, data, resume_from)
    _claim(run_dir, resume_from, data.folders, env, cleanup)
    cfg = resolve_precision(cfg, device, env, resume_from)
    s = build(cfg, env, device, init_weights)
    print0(run_header(cfg, s, data.tokenizer.name, env.world_size))
    eval_seconds = 0.0
    if cfg.train.time_budget:  # before config.toml and checkpoints record eval.tokens
        cfg, eval_seconds = fit_evaluations(cfg, s, data, env, evaluation_seconds(cfg))
    loader = train_loader(cfg, data, env)
    if not cfg.train.time_budget:  # a time budget's tokens are said once it has planned them
        print0(loader.describe(cfg.train.max_steps * cfg.train.batch_tokens))
    state = TrainState(max_steps=cfg.train.max_steps)
    checkpointer = Checkpointer(run_dir, cfg, data, s, env)
    changes = checkpointer.restore(resume_from, state, loader) if resume_from else []
    if resume_from and state.step >= state.max_steps:
        return _complete(run_dir, resume_from, state, cfg, env)
    restarting = (run_dir / METRICS).is_file()
    metrics = cleanup.enter_context(_open_metrics(cfg, run_dir, env))
    if restarting:  # readers drop what an earlier attempt logged past this step (rundir.read_metrics)
        metrics.write("resume", state.step, checkpoint=str(resume_from or ""), changes=changes)
    budget = TimeBudget(cfg, data.has_val, env, device, first_step=state.step)
    budget.expect_evaluation(eval_seconds)
    return _Run(
        cfg=cfg,
        env=env,
        s=s,
        loader=loader,
        state=state,
        checkpointer=checkpointer,
        metrics=metrics,
        evaluate=Evaluator(cfg, s, data, metrics, run_dir, env),
        budget=budget,
        utilisation=Utilisation(s.peak_flops, device, s.dtype),
        t_start=t_start,
        spent=state.seconds,
        step_loop=state.step,
    )


def _step(run: _Run, batches: Prefetcher) -> StepStats:
    """One optimizer step at the schedule's learning rate, counted; the time budget plans the step count after it."""
    cfg, s, state, world = run.cfg, run.s, run.state, run.env.world_size
    t0 = time.perf_counter()
    lr = set_lr(s.optimizer, state.decay.lr(state.step, cfg.optim, state.max_steps))
    accum = ramp_accumulation(state.tokens, s.grad_accum, cfg.train.batch_ramp_tokens)
    loss, norm, applied = train_step(
        s.train_model, s.model, s.optimizer, s.scaler, batches.next_batch, accum, cfg.optim.grad_clip, s.dtype, run.env
    )
    step_tokens = accum * cfg.train.micro_batch * cfg.model.block_size * world
    state.advance(applied, step_tokens)
    now = time.perf_counter()
    dt, state.seconds = now - t0, run.spent + now - run.t_start
    mfu = run.utilisation(s.model.flops_per_token(cfg.model.block_size) * step_tokens / dt / world)
    stats = StepStats(loss.item(), lr, float(norm), dt * 1000, step_tokens / dt, mfu)
    if not applied:
        run.print0(f"step {state.step}: non-finite loss or gradient ({stats.loss}, norm {stats.grad_norm}): skipped")
        state.check_skips(cfg.train.max_skips, run.checkpointer.last_good)
    state.max_steps = run.budget.plan(state.step, state.max_steps, now, state.seconds)
    return stats


def _report(run: _Run, batches: Prefetcher, stats: StepStats) -> None:
    """A step's metrics record, and its console line when due (every log.every, the first and the last step)."""
    state = run.state
    if run.budget.planned_now(state.step):
        run.print0(run.loader.describe(state.max_steps * run.cfg.train.batch_tokens))
    progress = run.loader.progress(batches.state_dict())
    run.metrics.write("train", state.step, **asdict(stats), tokens=state.tokens, skipped=state.skipped, **progress)
    if state.step % max(1, run.cfg.log.every) == 0 or state.step in (run.step_loop + 1, state.max_steps):
        pace = (time.perf_counter() - run.t_loop) / (state.step - run.step_loop)
        run.print0(_step_line(state, run.budget, pace, stats))


def _evaluate(run: _Run) -> dict[str, float] | None:
    """An evaluation at this step; the time budget keeps its time out of the steps' pace and plans with it."""
    val = run.evaluate(run.state.step)
    if val is not None:
        run.budget.evaluated(run.evaluate.seconds)
    return val


def _stop_now(run: _Run, stop: StopSignal) -> bool:
    """Whether every rank leaves the loop now: on any rank's stop signal (a checkpoint is saved). Out of time, the
    next step is made the last, so that the schedule's decay still ends at it."""
    state = run.state
    vote = run.budget.stop_vote(stop, state.seconds)
    if vote.out_of_time:
        state.max_steps = run.budget.last_step(state.step, state.max_steps)
    if vote.signal and state.step < state.max_steps:
        run.print0(f"stopping at step {state.step} of {state.max_steps} on a stop signal: saving a checkpoint")
        return True
    return False


def _complete(run_dir: Path, ckpt: Path, state: TrainState, cfg: Config, env: distributed.DistEnv) -> TrainResult:
    """A resumed run that has nothing left to train (a retried job, say): its log and checkpoints stay as they are."""
    message = f"{run_dir}: complete at step {state.step} of {state.max_steps}; nothing to train (raise max_steps)"
    distributed.print0(env, message)
    return TrainResult(run_dir, ckpt, state.step, state.tokens, 0.0, None, None, cfg)


@dataclass
class StepStats:
    """What a step logs (metrics.jsonl's train records) and prints."""

    loss: float
    lr: float
    grad_norm: float
    ms: float
    tokens_per_s: float
    mfu: float | None


def _step_line(state: TrainState, budget: TimeBudget, pace: float, stats: StepStats) -> str:
    """A step's progress line; its step count and ETA read '?' and 'calibrating' until the time budget plans them."""
    planned = not budget.calibrating(state.step)
    eta = format_duration(pace * (state.max_steps - state.step)) if planned else "calibrating"
    return (
        f"step {state.step:>6}/{state.max_steps if planned else '?'} | loss {stats.loss:.4f} | lr {stats.lr:.2e} | "
        f"norm {stats.grad_norm:.2f} | {stats.ms:.0f} ms | {stats.tokens_per_s:,.0f} tok/s | "
        f"MFU {format_mfu(stats.mfu)} | ETA {eta}"
    )


def _claim(
    run_dir: Path, resume_from: Path | None, data: list[str], env: distributed.DistEnv, cleanup: contextlib.ExitStack
) -> None:
    """Refuse a folder that is not this run's, then lock it for the run's life (rank 0)."""
    claim_run_dir(run_dir, resume_from, data)  # before the lock creates anything
    if env.is_main:  # one holder per run folder; the OS frees it if this process dies
        cleanup.enter_context(locked(run_dir, "train"))


def _open_metrics(cfg: Config, run_dir: Path, env: distributed.DistEnv) -> MetricsLog | NullLog:
    """Rank 0 writes the resolved config.toml and logs metrics; other ranks log nowhere."""
    if not env.is_main:
        return NullLog()
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / CONFIG, to_toml(cfg))
    return MetricsLog(run_dir, cfg.log.tensorboard, cfg.log.wandb, to_dict(cfg))
