"""FSDP2 (`fully_shard`) for train.parallel=fsdp: sharding a model, gradient sync between micro-steps, the whole
weights and optimizer state gathered from the shards (evaluation) or scattered back, and sharded checkpoints."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
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


def _whole():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on every process (evaluation, exports). Every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_whole())


def load_whole_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    state: dict[str, Any],
) -> None:
    """Scatter whole weights and optimizer state (held by every process) into the shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, weights, options=_whole())
    set_optimizer_state_dict(model, optimizer, state, options=_whole())


def optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimized parameter's name, in the optimizer's order (the indices of its own state_dict)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_index(state: dict) -> bool:
    return all(isinstance(p, int) for group in state.get("param_groups", []) for p in group["params"])


def state_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter names (FSDP's form), from either form: runs change parallelism."""
    if not _by_index(state):
        return state
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def state_by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by position (torch.optim's own form), from either form (Muon's passes as is)."""
    if "param_groups" not in state or _by_index(state):
        return state
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


# Sharded checkpoints (torch.distributed.checkpoint): every process writes its own shards, any number reads them.
MODEL, OPTIMIZER = "model", "optimizer"


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {MODEL: get_model_state_dict(model), OPTIMIZER: get_optimizer_state_dict(model, optimizer)}


@contextlib.contextmanager
def _own_errors() -> Iterator[None]:
    """DCP reports a process's failure as a CheckpointException, a BaseException that `except Exception` misses:
    raise the first failing process's own error instead (a full disk's OSError, a damaged file's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # reading in one process is the point: DCP warns that no group is initialized
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            yield
    except CheckpointException as e:
        failure = next(iter(e.failures.values()), None)
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, Exception):
            raise error from None
        raise RuntimeError(str(e).strip().splitlines()[-1]) from None


def wait_writes(writes: Any) -> None:
    """Wait for a background save's writes; a failure raises the failing process's own error."""
    with _own_errors():
        writes.result()


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, background: Any = None) -> Any:
    """Each process writes its shards of the weights and optimizer state into `folder` (rank 0 the index too). With
    a `background` process group (gloo: its own, so the writes never interleave with training's collectives) the
    state is copied to memory and written on a thread: returns the future to wait on (else None, written)."""
    import torch.distributed.checkpoint as dcp

    with _own_errors():
        if background is None:
            dcp.save(_sharded_state(model, optimizer), checkpoint_id=folder)
            return None
        return dcp.async_save(_sharded_state(model, optimizer), checkpoint_id=folder, process_group=background)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Weights and optimizer state from `folder` into `model` (sharded or whole) and `optimizer`, whatever the
    number of processes that wrote it. Every process must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _sharded_state(model, optimizer)
    with _own_errors():
        dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state[MODEL])
    set_optimizer_state_dict(model, optimizer, state[OPTIMIZER])


def load_shard_weights(model: torch.nn.Module, folder: Path) -> None:
    """The weights alone from `folder` into a whole model (evaluation, sampling, export)."""
    import torch.distributed.checkpoint as dcp

    with _own_errors():
        dcp.load({MODEL: model.state_dict()}, checkpoint_id=folder)


def _index(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata()


def shard_shapes(folder: Path) -> dict[str, list[int]] | None:
    """The shape of every weight in `folder`'s index, by parameter name (None: no readable index)."""
    try:
        index = _index(folder)
    except Exception:  # noqa: BLE001 - unreadable: shards_problem and loading say how
        return None
    prefix = f"{MODEL}."
    return {
        name.removeprefix(prefix): list(entry.size)
        for name, entry in index.state_dict_metadata.items()
        if name.startswith(prefix) and hasattr(entry, "size")
    }


def shards_problem(folder: Path) -> str | None:
    """Why sharded checkpoint `folder` cannot be read, or None: its index unreadable, a process's file missing or
    shorter than the index says."""
    try:
        index = _index(folder)
    except Exception as e:  # noqa: BLE001 - whatever the bytes are, the answer is "unreadable"
        return f"{folder.name}/.metadata is missing or unreadable ({type(e).__name__})"
    ends: dict[str, int] = {}
    for item in index.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            return f"{folder.name}/{name}, one process's shards, is missing"
        if path.stat().st_size < end:
            return f"{folder.name}/{name} is truncated ({path.stat().st_size:,} bytes, expected {end:,})"
    return None
