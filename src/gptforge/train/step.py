"""One optimizer step over accumulated micro-batches: the step the trainer runs and `gptforge bench` times."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from gptforge.runtime.device import autocast
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_mean
from gptforge.runtime.fsdp import gradient_sync, local_norm

# The step's parts as a profile names them (benchmarks/profile_step.py); what lies outside them is data and Python.
PHASES = ("step.forward", "step.backward", "step.clip", "step.finite_check", "step.optimizer")
FORWARD, BACKWARD, CLIP, FINITE_CHECK, OPTIMIZER = PHASES


def train_step(
    train_model: Callable[..., tuple[Any, torch.Tensor]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    accum: int,
    grad_clip: float,
    dtype: torch.dtype,
    env: DistEnv = SINGLE,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer step over `accum` micro-batches: (mean loss over ranks, pre-clip gradient norm, applied?).

    A step whose loss or gradient is not finite is skipped, not applied.
    """
    device = next(model.parameters()).device
    loss_accum = torch.zeros((), device=device)
    for micro in range(accum):
        x, y = next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # DDP and FSDP reduce gradients in backward; only the last micro-step needs it.
        with gradient_sync(model, train_model, sync=micro == accum - 1):
            with record_function(FORWARD), autocast(device, dtype):
                _, loss = train_model(x, y)
                # Accumulated gradients are a SUM over micro-batches; scale each so the step sees the MEAN.
                loss = loss / accum
            loss_accum += loss.detach()
            with record_function(BACKWARD):
                scaler.scale(loss).backward()
    with record_function(CLIP):
        scaler.unscale_(optimizer)
        clip = grad_clip if grad_clip > 0 else float("inf")
        norm = local_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))  # pre-clip, same on every rank
        all_reduce_mean(loss_accum, env)
    with record_function(FINITE_CHECK):
        # The step's wait for the device: the loss and norm the trainer reads next are ready by then.
        finite = bool(torch.isfinite(norm) & torch.isfinite(loss_accum))
    with record_function(OPTIMIZER):
        if finite:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss_accum, norm, finite
