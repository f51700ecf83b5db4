"""The training loop: GPT-3 recipe (AdamW, warm-up + cosine, accumulation, clipping), eval, checkpoints, logs.

One process, or one per device under torchrun (DDP: gradients sync on the last micro-step only). Every rank
runs this same loop; only rank 0 prints, logs and writes checkpoints (each rank adds its RNG state).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptforge import distributed
from gptforge.checkpoint import (
    load_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    restore_training_state,
    save_checkpoint,
)
from gptforge.config import Config, to_dict, to_toml
from gptforge.data.loader import TokenLoader
from gptforge.data.prefetch import Prefetcher
from gptforge.data.shards import read_manifest
from gptforge.errors import GptforgeError
from gptforge.evaluate import evaluate_loss
from gptforge.generate import generate
from gptforge.hellaswag import evaluate_hellaswag, read_examples
from gptforge.metrics import MetricsLog, NullLog, format_duration, peak_flops
from gptforge.model import GPT
from gptforge.optim import build_optimizer, lr_at
from gptforge.publish import export_and_push
from gptforge.runtime import autocast, resolve_device, resolve_dtype, setup_fast_math
from gptforge.tokenizer import load_tokenizer, same_tokenizer

# A time budget fixes the step count from the pace of steps CALIBRATION_START..CALIBRATION_END
# (the first steps pay for warm-up: allocator, compilation).
CALIBRATION_START, CALIBRATION_END = 5, 25


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path
    steps: int
    tokens: int
    seconds: float
    first_val: dict[str, float] | None
    last_val: dict[str, float] | None


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


def train_step(
    train_model: Callable[..., tuple[Any, torch.Tensor]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    accum: int,
    grad_clip: float,
    dtype: torch.dtype,
    env: distributed.DistEnv = distributed.SINGLE,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step over `accum` micro-batches: (mean loss over ranks, pre-clip gradient norm, applied?).

    A step whose loss or gradient is not finite is skipped, not applied; `gptforge bench` times this same step.
    """
    device = next(model.parameters()).device
    loss_accum = torch.zeros((), device=device)
    for micro in range(accum):
        x, y = next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # DDP all-reduces gradients in backward; only the last micro-step needs it.
        last_micro = micro == accum - 1
        with contextlib.nullcontext() if last_micro or not env.distributed else train_model.no_sync():
            with autocast(device, dtype):
                _, loss = train_model(x, y)
                # Accumulated gradients are a SUM over micro-batches; scale each so the step sees the MEAN.
                loss = loss / accum
            loss_accum += loss.detach()
            scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # the pre-clip norm, same on every rank
    distributed.all_reduce_mean(loss_accum, env)
    finite = bool(torch.isfinite(norm)) and bool(torch.isfinite(loss_accum))  # the one host sync per step
    if finite:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_accum, norm, finite


def train(cfg: Config, run_dir: str | Path, resume: str | None = None) -> TrainResult:
    """Train with `cfg` into RUN_DIR; under torchrun each process calls this."""
    env, device_name = distributed.init(cfg.train.device)
    try:
        with StopSignal() as stop, contextlib.ExitStack() as cleanup:
            return _train(cfg, Path(run_dir), resume, env, resolve_device(device_name), stop, cleanup)
    finally:
        distributed.cleanup()


def _train(
    cfg: Config,
    run_dir: Path,
    resume: str | None,
    env: distributed.DistEnv,
    device: torch.device,
    stop: StopSignal,
    cleanup: contextlib.ExitStack,
) -> TrainResult:
    t_start = time.perf_counter()
    print0 = print if env.is_main else (lambda *a, **k: None)
    if not cfg.data.path:
        raise GptforgeError("no training data: pass --data DIR (a folder written by `gptforge prepare`)")
    manifest = read_manifest(cfg.data.path)
    tokenizer = load_tokenizer(manifest["tokenizer"]["name"], cfg.data.path)
    init_model = None
    if cfg.train.init_from:
        init_model, init_tok, init_cfg, _ = load_checkpoint(cfg.train.init_from)
        if not same_tokenizer(init_tok, tokenizer):
            raise GptforgeError(
                f"train.init_from={cfg.train.init_from}: its tokenizer ({init_tok.name}, {init_tok.vocab_size}) "
                f"differs from the data's ({tokenizer.name}, {tokenizer.vocab_size}); prepare the data with it"
            )
        cfg.model = init_cfg.model
    cfg.model.vocab_size = tokenizer.vocab_size  # the data decides the vocabulary
    has_val = any(s["split"] == "val" for s in manifest["shards"])
    lr_at(0, cfg.optim, 1)  # an unknown schedule fails now, not after the first evaluation

    dtype = resolve_dtype(cfg.train.dtype, device)
    setup_fast_math(device)
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank

    # Global batch in tokens; accumulation makes up what the ranks' micro-batches do not hold.
    B, T, world = cfg.train.micro_batch, cfg.model.block_size, env.world_size
    if B <= 0 or cfg.train.batch_tokens % (B * T * world):
        raise GptforgeError(
            f"train.batch_tokens={cfg.train.batch_tokens} must be a positive multiple of "
            f"train.micro_batch x model.block_size x processes = {B} x {T} x {world}"
        )
    grad_accum = cfg.train.batch_tokens // (B * T * world)
    model = GPT(cfg.model)
    if init_model is not None:
        model.load_state_dict(init_model.state_dict())
    model.to(device)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.fused_loss = cfg.train.fused_loss
    train_model = distributed.wrap(torch.compile(model) if cfg.train.compile else model, env, device)
    optimizer = build_optimizer(model, cfg.optim, device.type, zero=cfg.train.zero and env.distributed)
    # fp16 (GPUs without bf16) needs loss scaling; for bf16 and fp32 the scaler is a pass-through.
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16 and device.type == "cuda")
    loader = TokenLoader(cfg.data.path, "train", B, T, env.rank, world, cfg.train.seed, cfg.data.shuffle)
    peak, peak_source = peak_flops(device, dtype, cfg.train.peak_flops)
    print0(
        f"model: {model.num_params():,} parameters, {model.flops_per_token(T) / 1e6:,.0f} MFLOP/token, "
        f"{cfg.model.n_layer} layers, {cfg.model.n_embd} wide, context {T}, vocab {cfg.model.vocab_size} "
        f"({tokenizer.name}) | {world} x {device} {str(dtype)[6:]}{' compiled' if cfg.train.compile else ''}\n"
        f"batch: {cfg.train.batch_tokens:,} tokens/step = {B} seq x {T} tokens x "
        f"{world} process{'es' if world > 1 else ''} x {grad_accum} accumulation | "
        f"MFU against {peak / 1e12:,.1f} TFLOP/s ({peak_source})",
        flush=True,
    )

    step, tokens_seen, max_steps, skipped_total, last_good = 0, 0, cfg.train.max_steps, 0, None
    if resume:
        ckpt = last_good = resolve_checkpoint(run_dir if resume == "auto" else resume)
        meta = restore_training_state(ckpt, model, optimizer, device, env)
        loader.load_state_dict(meta["loader"])
        step, tokens_seen, max_steps = meta["step"], meta["tokens"], meta["max_steps"]
        skipped_total = meta.get("skipped_steps", 0)
        if meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        print0(f"resumed from {ckpt} at step {step}", flush=True)

    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        metrics = MetricsLog(run_dir, cfg.log.tensorboard, cfg.log.wandb, to_dict(cfg))
    else:
        metrics = NullLog()

    hellaswag = read_examples(cfg.eval.hellaswag, cfg.eval.hellaswag_limit) if cfg.eval.hellaswag else []
    val_loader = TokenLoader(cfg.data.path, "val", B, T, shuffle=False) if has_val else None

    def evaluate(at_step: int) -> dict[str, float]:
        t = time.perf_counter()
        val = evaluate_loss(model, cfg.data.path, B, T, cfg.eval.tokens, device, dtype, env=env, loader=val_loader)
        metrics.write("val", at_step, **val)
        if hellaswag:
            hs = evaluate_hellaswag(model, tokenizer, hellaswag, device, dtype, env)
            metrics.write("hellaswag", at_step, **hs)
            print0(f"step {at_step:>6} | hellaswag acc_norm {hs['acc_norm']:.4f} | acc {hs['acc']:.4f} | n {hs['n']}")
        if cfg.eval.sample_tokens > 0 and env.is_main:
            g = torch.Generator(device=device).manual_seed(cfg.train.seed + at_step)  # training RNG untouched
            with autocast(device, dtype):
                new = generate(
                    model,
                    tokenizer.encode(cfg.eval.prompt),
                    cfg.eval.sample_tokens,
                    top_k=50,
                    eot=tokenizer.eot,
                    generator=g,
                )
            with open(run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
                text = cfg.eval.prompt + tokenizer.decode(new[0])
                f.write(json.dumps({"step": at_step, "prompt": cfg.eval.prompt, "text": text}) + "\n")
            print0(f"step {at_step:>6} | sample: {text!r}")
        print0(
            f"step {at_step:>6} | val loss {val['loss']:.4f} | ppl {val['ppl']:.2f} | bpb {val['bpb']:.3f} | "
            f"{time.perf_counter() - t:.1f}s",
            flush=True,
        )
        return val

    def checkpoint(at_step: int) -> Path:
        extra = {
            "tokens": tokens_seen,
            "max_steps": max_steps,
            "loader": batches.state_dict(),
            "skipped_steps": skipped_total,
            "scaler": scaler.state_dict(),
        }
        path = save_checkpoint(run_dir, at_step, model, optimizer, cfg, tokenizer, extra, env)
        if env.is_main and cfg.checkpoint.keep_last:
            prune_checkpoints(run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.milestone_every)
        if env.is_main and cfg.checkpoint.push:
            branch = cfg.checkpoint.push_branch or run_dir.resolve().name
            commit = export_and_push(model, tokenizer, cfg.checkpoint.push, branch, f"step {at_step}")
            print0(f"pushed step {at_step} to {cfg.checkpoint.push} branch {branch} ({commit[:12]})", flush=True)
        return path

    def ramp_accum(tokens: int) -> int:
        """GPT-3's batch ramp: micro-steps grow linearly with the tokens seen, from 1 to grad_accum."""
        return max(1, min(grad_accum, math.ceil(grad_accum * (tokens + 1) / cfg.train.batch_ramp_tokens)))

    t_eval = time.perf_counter()
    first_val = evaluate(step) if has_val and step == 0 else None
    eval_seconds = time.perf_counter() - t_eval
    last_val = first_val
    t_calibrate, skipped_in_row = None, 0
    t_loop, step_loop = time.perf_counter(), step
    model.train()
    # Batches are read ahead on a thread; `batches.state_dict()` is the position after the last one trained on.
    batches = cleanup.enter_context(Prefetcher(loader, pin_memory=device.type == "cuda"))
    while step < max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.optim, max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        accum = ramp_accum(tokens_seen) if cfg.train.batch_ramp_tokens else grad_accum
        loss, norm, applied = train_step(
            train_model, model, optimizer, scaler, batches.next_batch, accum, cfg.optim.grad_clip, dtype, env
        )
        if applied:
            skipped_in_row = 0
        else:
            skipped_total, skipped_in_row = skipped_total + 1, skipped_in_row + 1
        step += 1
        step_tokens = accum * B * T * world
        tokens_seen += step_tokens
        loss_value = loss.item()
        dt = time.perf_counter() - t0
        elapsed = time.perf_counter() - t_start
        if skipped_in_row:
            print0(f"step {step}: non-finite loss or gradient ({loss_value}, norm {float(norm)}): update skipped")
            if skipped_in_row >= cfg.train.max_skips:
                raise GptforgeError(
                    f"{skipped_in_row} steps in a row with a non-finite loss or gradient, the last at step {step}; "
                    f"last good checkpoint: {last_good or 'none yet'} (lower optim.lr or check the data)"
                )

        if cfg.train.time_budget > 0 and step == CALIBRATION_START:
            t_calibrate = time.perf_counter()
        elif cfg.train.time_budget > 0 and step == CALIBRATION_END and t_calibrate is not None:
            per_step = (time.perf_counter() - t_calibrate) / (CALIBRATION_END - CALIBRATION_START)
            if cfg.eval.every and has_val:
                per_step += eval_seconds / cfg.eval.every
            left = cfg.train.time_budget - elapsed - eval_seconds
            max_steps = distributed.broadcast_int(max(step, min(max_steps, step + int(left / per_step))), env, device)
            print0(f"time budget {cfg.train.time_budget:.0f}s: {per_step:.2f}s/step -> {max_steps} steps", flush=True)

        mfu = model.flops_per_token(T) * step_tokens / dt / world / peak if peak else 0.0
        metrics.write(
            "train",
            step,
            loss=loss_value,
            lr=lr,
            grad_norm=float(norm),
            ms=dt * 1000,
            tokens=tokens_seen,
            tokens_per_s=step_tokens / dt,
            mfu=mfu,
            skipped=skipped_total,
        )
        if step % max(1, cfg.log.every) == 0 or step == max_steps:
            eta = (time.perf_counter() - t_loop) / (step - step_loop) * (max_steps - step)
            calibrating = cfg.train.time_budget > 0 and step < CALIBRATION_END
            print0(
                f"step {step:>6}/{'?' if calibrating else max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"norm {float(norm):.2f} | {dt * 1000:.0f} ms | {step_tokens / dt:,.0f} tok/s | "
                f"MFU {mfu:.1%} | ETA {'calibrating' if calibrating else format_duration(eta)}",
                flush=True,
            )
        if step < max_steps and has_val and cfg.eval.every and step % cfg.eval.every == 0:
            last_val = evaluate(step)
        if step < max_steps and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            last_good = checkpoint(step)
        # Every rank must leave the loop at the same step: rank 0's clock decides the budget, any rank's signal stops.
        out_of_time = cfg.train.time_budget > 0 and elapsed > cfg.train.time_budget and env.is_main
        votes = torch.tensor([stop.received is not None, out_of_time], dtype=torch.long, device=device)
        if env.distributed:
            distributed.all_reduce_sum(votes, env)
        if step < max_steps and votes.any():
            why = "a stop signal" if votes[0] else f"the time budget of {cfg.train.time_budget:.0f}s"
            print0(f"stopping at step {step} on {why}: saving a checkpoint", flush=True)
            break

    if has_val:
        last_val = evaluate(step)
    last_good = checkpoint(step)
    metrics.close()
    seconds = time.perf_counter() - t_start
    print0(f"done: {step} steps, {tokens_seen:,} tokens in {format_duration(seconds)}; saved {last_good}", flush=True)
    return TrainResult(run_dir, last_good, step, tokens_seen, seconds, first_val, last_val)
