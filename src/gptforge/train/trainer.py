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
from gptforge.data.prefetch import Prefetcher
from gptforge.files import atomic_write, locked
from gptforge.rundir import CONFIG, METRICS, format_duration
from gptforge.runtime import distributed
from gptforge.runtime.device import resolve_device
from gptforge.runtime.flops import Utilisation, format_mfu
from gptforge.train.checkpointer import Checkpointer, find_resume
from gptforge.train.claim import claim_run_dir
from gptforge.train.evaluator import Evaluator
from gptforge.train.metrics import MetricsLog, NullLog
from gptforge.train.optim import lr_at, set_lr
from gptforge.train.setup import build, open_data, resolve_config, resolve_precision, run_header, train_loader
from gptforge.train.state import TrainState, ramp_accumulation
from gptforge.train.step import train_step
from gptforge.train.stopping import StopSignal, TimeBudget


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
                Path(run_dir),
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
    print0 = functools.partial(distributed.print0, env)
    data = open_data(cfg)
    cfg, init_weights = resolve_config(cfg, data.tokenizer)
    resume_from = _claim(run_dir, resume, data.folders, env, cleanup)
    cfg = resolve_precision(cfg, device, env, resume_from)
    s = build(cfg, env, device, init_weights)
    print0(run_header(cfg, s, data.tokenizer.name, env.world_size))
    B, T, world = cfg.train.micro_batch, cfg.model.block_size, env.world_size
    loader = train_loader(cfg, data, env)
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
    evaluate = Evaluator(cfg, s, data, metrics, run_dir, env)
    budget = TimeBudget(cfg, data.has_val, env, device, first_step=state.step)
    utilisation = Utilisation(s.peak_flops, device, s.dtype)

    first_val = last_val = evaluate(state.step) if state.step == 0 else None
    budget.evaluated(evaluate.seconds)
    spent = state.seconds  # by earlier commands of this run: a time budget is the run's
    t_loop, step_loop = time.perf_counter(), state.step
    s.model.train()
    # Batches are read ahead on a thread; `batches.state_dict()` is the position after the last one trained on.
    batches = cleanup.enter_context(Prefetcher(loader, pin_memory=device.type == "cuda"))
    while state.step < state.max_steps:
        t0 = time.perf_counter()
        lr = set_lr(s.optimizer, lr_at(state.step, cfg.optim, state.max_steps))
        accum = ramp_accumulation(state.tokens, s.grad_accum, cfg.train.batch_ramp_tokens)
        loss, norm, applied = train_step(
            s.train_model, s.model, s.optimizer, s.scaler, batches.next_batch, accum, cfg.optim.grad_clip, s.dtype, env
        )
        step_tokens = accum * B * T * world
        state.advance(applied, step_tokens)
        now = time.perf_counter()
        dt, state.seconds = now - t0, spent + now - t_start
        mfu = utilisation(s.model.flops_per_token(T) * step_tokens / dt / world)
        stats = StepStats(loss.item(), lr, float(norm), dt * 1000, step_tokens / dt, mfu)
        if not applied:
            print0(f"step {state.step}: non-finite loss or gradient ({stats.loss}, norm {stats.grad_norm}): skipped")
            state.check_skips(cfg.train.max_skips, checkpointer.last_good)
        state.max_steps = budget.plan(state.step, state.max_steps, now, state.seconds)
        progress = loader.progress(batches.state_dict())
        metrics.write("train", state.step, **asdict(stats), tokens=state.tokens, skipped=state.skipped, **progress)
        if state.step % max(1, cfg.log.every) == 0 or state.step in (step_loop + 1, state.max_steps):
            pace = (time.perf_counter() - t_loop) / (state.step - step_loop)
            print0(_step_line(state, budget, pace, stats))
        if state.step < state.max_steps and evaluate.due(state.step):
            last_val = evaluate(state.step)
            budget.evaluated(evaluate.seconds)
        if state.step < state.max_steps and checkpointer.due(state.step):
            checkpointer.save(state, batches, background=True)
            budget.saved(checkpointer.seconds)
        # Every rank must leave the loop at the same step.
        why = budget.stop_vote(stop, state.seconds)
        if state.step < state.max_steps and why:
            print0(f"stopping at step {state.step} of {state.max_steps} on {why}: saving a checkpoint")
            break

    last_val = evaluate(state.step) or last_val
    final = checkpointer.save(state, batches)
    seconds = time.perf_counter() - t_start
    print0(f"done: {state.step} steps, {state.tokens:,} tokens in {format_duration(seconds)}; saved {final}")
    return TrainResult(run_dir, final, state.step, state.tokens, seconds, first_val, last_val, cfg)


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
    run_dir: Path, resume: str | None, data: list[str], env: distributed.DistEnv, cleanup: contextlib.ExitStack
) -> Path | None:
    """Refuse a folder that is not this run's, then lock it for the run's life (rank 0); the checkpoint to resume."""
    resume_from = find_resume(run_dir, resume)
    claim_run_dir(run_dir, resume_from, data)  # before the lock creates anything
    if env.is_main:  # one holder per run folder; the OS frees it if this process dies
        cleanup.enter_context(locked(run_dir, "train"))
    return resume_from


def _open_metrics(cfg: Config, run_dir: Path, env: distributed.DistEnv) -> MetricsLog | NullLog:
    """Rank 0 writes the resolved config.toml and logs metrics; other ranks log nowhere."""
    if not env.is_main:
        return NullLog()
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / CONFIG, to_toml(cfg))
    return MetricsLog(run_dir, cfg.log.tensorboard, cfg.log.wandb, to_dict(cfg))
