"""Process groups from the torchrun / `accelerate launch` environment, model wrapping, reductions, print0.

A plain `python -m gptforge train` is a world of one: every helper here is then a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gptforge.errors import GptforgeError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = DistEnv()  # a world of one


def init(device_name: str) -> tuple[DistEnv, str]:
    """Join the process group the launcher describes (RANK, LOCAL_RANK, WORLD_SIZE); returns the env and the
    device this rank should use: cuda:LOCAL_RANK on GPUs (nccl), the requested device otherwise (gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistEnv(), device_name
    env = DistEnv(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world)
    use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
        device_name = f"cuda:{env.local_rank}"
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if dist.get_world_size() != world:
        raise GptforgeError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} processes")
    return env, device_name


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """DDP around the model when there is more than one process."""
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def print0(env: DistEnv, *args: object) -> None:
    """Print (flushed) on rank 0 only: one copy of each line however many processes run."""
    if env.is_main:
        print(*args, flush=True)


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """In place; gloo has no AVG, so sum and divide on every backend."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def broadcast_int(value: int, env: DistEnv, device: torch.device) -> int:
    """Rank 0's value on every rank (a step count or a stop decision taken from rank 0's clock or signals)."""
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())
