"""The training loop: GPT-3 recipe (AdamW, warm-up + cosine, accumulation, clipping), eval, checkpoints, logs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gptforge.checkpoint import load_checkpoint, resolve_checkpoint, restore_training_state, save_checkpoint
from gptforge.config import Config, to_toml
from gptforge.data.loader import TokenLoader
from gptforge.data.shards import read_manifest
from gptforge.errors import GptforgeError
from gptforge.evaluate import evaluate_loss
from gptforge.generate import generate
from gptforge.metrics import MetricsLog, format_duration
from gptforge.model import GPT
from gptforge.optim import build_optimizer, cosine_lr
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


def train(cfg: Config, run_dir: str | Path, resume: str | None = None) -> TrainResult:
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
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

    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.train.dtype, device)
    setup_fast_math(device)
    torch.manual_seed(cfg.train.seed)

    # Global batch in tokens; accumulation makes up what one micro-batch does not hold.
    B, T = cfg.train.micro_batch, cfg.model.block_size
    if B <= 0 or cfg.train.batch_tokens % (B * T):
        raise GptforgeError(
            f"train.batch_tokens={cfg.train.batch_tokens} must be a positive multiple of "
            f"train.micro_batch x model.block_size = {B} x {T}"
        )
    grad_accum = cfg.train.batch_tokens // (B * T)
    model = GPT(cfg.model)
    if init_model is not None:
        model.load_state_dict(init_model.state_dict())
    model.to(device)
    train_model = torch.compile(model) if cfg.train.compile else model
    optimizer = build_optimizer(model, cfg.optim, device.type)
    loader = TokenLoader(cfg.data.path, "train", B, T, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    print(
        f"model: {model.num_params():,} parameters, {model.flops_per_token(T) / 1e6:,.0f} MFLOP/token, "
        f"{cfg.model.n_layer} layers, {cfg.model.n_embd} wide, "
        f"context {T}, vocab {cfg.model.vocab_size} ({tokenizer.name}) | {device} {str(dtype)[6:]}"
        f"{' compiled' if cfg.train.compile else ''}\n"
        f"batch: {cfg.train.batch_tokens:,} tokens/step = {B} seq x {T} tokens x {grad_accum} accumulation",
        flush=True,
    )

    step, tokens_seen, max_steps = 0, 0, cfg.train.max_steps
    if resume:
        ckpt = resolve_checkpoint(run_dir if resume == "auto" else resume)
        meta = restore_training_state(ckpt, model, optimizer, device)
        loader.load_state_dict(meta["loader"])
        step, tokens_seen, max_steps = meta["step"], meta["tokens"], meta["max_steps"]
        print(f"resumed from {ckpt} at step {step}", flush=True)

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    samples_path = run_dir / "samples.jsonl"

    def evaluate(at_step: int) -> dict[str, float]:
        t = time.perf_counter()
        val = evaluate_loss(model, cfg.data.path, B, T, cfg.eval.tokens, device, dtype)
        metrics.write("val", at_step, **val)
        if cfg.eval.sample_tokens > 0:
            g = torch.Generator(device=device).manual_seed(cfg.train.seed + at_step)
            prompt = tokenizer.encode(cfg.eval.prompt)
            with autocast(device, dtype):
                new = generate(model, prompt, cfg.eval.sample_tokens, top_k=50, eot=tokenizer.eot, generator=g)
            text = cfg.eval.prompt + tokenizer.decode(new[0])
            with open(samples_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": at_step, "prompt": cfg.eval.prompt, "text": text}) + "\n")
        print(
            f"step {at_step:>6} | val loss {val['loss']:.4f} | ppl {val['ppl']:.2f} | bpb {val['bpb']:.3f} | "
            f"{time.perf_counter() - t:.1f}s",
            flush=True,
        )
        return val

    def checkpoint(at_step: int) -> Path:
        extra = {"tokens": tokens_seen, "max_steps": max_steps, "loader": loader.state_dict()}
        path = save_checkpoint(run_dir, at_step, model, optimizer, cfg, tokenizer, extra)
        if cfg.checkpoint.push:
            branch = cfg.checkpoint.push_branch or run_dir.resolve().name
            commit = export_and_push(model, tokenizer, cfg.checkpoint.push, branch, f"step {at_step}")
            print(f"pushed step {at_step} to {cfg.checkpoint.push} branch {branch} ({commit[:12]})", flush=True)
        return path

    t_eval = time.perf_counter()
    first_val = evaluate(step) if has_val and step == 0 else None
    eval_seconds = time.perf_counter() - t_eval
    last_val = first_val
    min_lr = cfg.optim.lr * cfg.optim.min_lr_ratio
    t_calibrate = None
    t_loop, step_loop = time.perf_counter(), step
    model.train()
    while step < max_steps:
        t0 = time.perf_counter()
        lr = cosine_lr(step, cfg.optim.lr, min_lr, cfg.optim.warmup_steps, max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_accum = torch.zeros((), device=device)
        for _ in range(grad_accum):
            x, y = loader.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, dtype):
                _, loss = train_model(x, y)
            # Accumulated gradients are a SUM over micro-batches; scale each so the step sees the MEAN.
            loss = loss / grad_accum
            loss_accum += loss.detach()
            loss.backward()
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += cfg.train.batch_tokens
        loss_value = loss_accum.item()  # the one host sync per step, for logging
        dt = time.perf_counter() - t0
        elapsed = time.perf_counter() - t_start

        if cfg.train.time_budget > 0 and step == CALIBRATION_START:
            t_calibrate = time.perf_counter()
        elif cfg.train.time_budget > 0 and step == CALIBRATION_END and t_calibrate is not None:
            per_step = (time.perf_counter() - t_calibrate) / (CALIBRATION_END - CALIBRATION_START)
            if cfg.eval.every and has_val:
                per_step += eval_seconds / cfg.eval.every
            left = cfg.train.time_budget - elapsed - eval_seconds
            max_steps = max(step, min(max_steps, step + int(left / per_step)))
            print(f"time budget {cfg.train.time_budget:.0f}s: {per_step:.2f}s/step -> {max_steps} steps", flush=True)

        metrics.write(
            "train",
            step,
            loss=loss_value,
            lr=lr,
            grad_norm=float(norm),
            ms=dt * 1000,
            tokens=tokens_seen,
            tokens_per_s=cfg.train.batch_tokens / dt,
        )
        if step % max(1, cfg.log.every) == 0 or step == max_steps:
            eta = (time.perf_counter() - t_loop) / (step - step_loop) * (max_steps - step)
            calibrating = cfg.train.time_budget > 0 and step < CALIBRATION_END
            print(
                f"step {step:>6}/{'?' if calibrating else max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"norm {float(norm):.2f} | {dt * 1000:.0f} ms | {cfg.train.batch_tokens / dt:,.0f} tok/s | "
                f"ETA {'calibrating' if calibrating else format_duration(eta)}",
                flush=True,
            )
        if step < max_steps and has_val and cfg.eval.every and step % cfg.eval.every == 0:
            last_val = evaluate(step)
        if step < max_steps and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            checkpoint(step)
        if cfg.train.time_budget > 0 and elapsed > cfg.train.time_budget and step < max_steps:
            print(f"time budget of {cfg.train.time_budget:.0f}s spent: stopping at step {step}", flush=True)
            max_steps = step

    if has_val:
        last_val = evaluate(step)
    last_ckpt = checkpoint(step)
    metrics.close()
    seconds = time.perf_counter() - t_start
    print(f"done: {step} steps, {tokens_seen:,} tokens in {format_duration(seconds)}; saved {last_ckpt}", flush=True)
    return TrainResult(run_dir, last_ckpt, step, tokens_seen, seconds, first_val, last_val)
