"""FSDP2 (`fully_shard`) for train.parallel=fsdp: sharding a model, gradient sync between micro-steps, and the
whole weights and optimizer state gathered from the shards (for checkpoints and evaluation) or scattered back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

try:  # public from torch 2.6; torch 2.4-2.5 keep it under _composable
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def shard(
    model: torch.nn.Module,
    blocks: Iterable[torch.nn.Module],
    device: torch.device,
    dtype: torch.dtype,
    reshard_after_forward: bool,
) -> torch.nn.Module:
    """Shard each block, then the root (embeddings, final norm, head), over all processes on `device`'s kind, as
    torchtitan does: parameters in `dtype` for compute, gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh

    # An explicit mesh of the run's device kind: a GPU beside a gloo (CPU) group must not draw the shards onto it.
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    compute = None if dtype == torch.float32 else dtype
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, train_model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Within it, backward reduces gradients across processes only if `sync` (the last micro-step): FSDP and DDP
    accumulate the others locally."""
    if sync:
        yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(train_model, "no_sync"):
        with train_model.no_sync():
            yield
    else:
        yield


def local_norm(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm as a plain tensor (over sharded gradients clipping returns a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _options(rank0_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)


def whole_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, rank0_only: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The unsharded weights and optimizer state (keyed by parameter names), on CPU and rank 0 only when
    `rank0_only` (a checkpoint), else on every rank (evaluation). Every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_options(rank0_only))
    state = get_optimizer_state_dict(model, optimizer, options=_options(rank0_only)) if optimizer else None
    return weights, state


def load_whole_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict[str, torch.Tensor],
    state: dict[str, Any] | None,
) -> None:
    """Scatter whole weights and optimizer state (held by every process) into the shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, weights, options=_options(False))
    if optimizer is not None and state is not None:
        set_optimizer_state_dict(model, optimizer, state, options=_options(False))
