"""Process groups from the torchrun / `accelerate launch` environment, model wrapping, reductions, print0.

A plain `python -m gptforge train` is a world of one: every helper here is then a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

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


# Where launchers put a process's place, in the order accelerate reads them: torchrun (and accelerate --multi_gpu),
# then MPI's (Intel MPI/MPICH's PMI, Open MPI, MVAPICH), which `accelerate launch --cpu --mpirun_hostfile` starts.
_RANK = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_LOCAL_RANK = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_WORLD_SIZE = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launch_env(environ: Mapping[str, str]) -> DistEnv:
    """This process's place in the job its launcher describes; a world of one without a launcher."""

    def first(names: tuple[str, ...], default: int) -> int:
        return next((int(environ[name]) for name in names if name in environ), default)

    world = first(_WORLD_SIZE, 1)
    return DistEnv(first(_RANK, 0), first(_LOCAL_RANK, 0), world) if world > 1 else SINGLE


def init(device_name: str, timeout: float) -> tuple[DistEnv, str]:
    """Join the process group the launcher describes (torchrun's RANK, LOCAL_RANK, WORLD_SIZE, or MPI's), its
    collectives failing after `timeout` seconds; returns the env and this rank's device: cuda:LOCAL_RANK (nccl), else
    the requested (gloo)."""
    env = launch_env(os.environ)
    world = env.world_size
    if world == 1:
        check_single_process(os.environ)
        return env, device_name
    if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():  # torchrun sets them; under mpirun, accelerate does
        raise GptforgeError(
            f"rank {env.rank} of {world}: MASTER_ADDR and MASTER_PORT must name rank 0's host and a free port "
            "(torchrun and accelerate launch set them; plain mpirun does not)"
        )
    use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
        device_name = f"cuda:{env.local_rank}"
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        wait = datetime.timedelta(seconds=timeout)
        store = restart_store(os.environ, world, wait)
        dist.init_process_group(backend, timeout=wait, rank=env.rank, world_size=world, store=store)
    if dist.get_world_size() != world:
        raise GptforgeError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} processes")
    return env, device_name


def restart_store(environ: Mapping[str, str], world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's store with this restart's own keys (None: let torch make it). torchrun keeps one store for all its
    restarts, so a restarted group read the dead workers' addresses and failed to connect (pytorch#167288)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size=world, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"gptforge/restart{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def check_single_process(environ: Mapping[str, str]) -> None:
    """Refuse a world of one where `accelerate launch` was asked for more: without --multi_gpu or --mpirun_hostfile it
    starts ONE process whatever `--num_processes` says, and sets MASTER_ADDR only when more were asked for."""
    if "ACCELERATE_USE_CPU" in environ and "MASTER_ADDR" in environ:
        raise GptforgeError(
            "accelerate launch started 1 process, not the --num_processes/--num_machines asked for (its --cpu "
            "launcher starts one unless given --mpirun_hostfile); use `accelerate launch --multi_gpu --num_processes "
            "N` (gloo on CPUs), `--cpu --num_processes N --mpirun_hostfile FILE`, or `torchrun --nproc_per_node N`"
        )


# `accelerate launch --mixed_precision` (ACCELERATE_MIXED_PRECISION, "no" unless given) as train.dtype.
ACCELERATE_DTYPES = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}


def launcher_overrides(overrides: list[str], environ: Mapping[str, str]) -> tuple[list[str], str]:
    """`--set` overrides preceded by the train.dtype `accelerate launch --mixed_precision` asks for (so an explicit
    `--set train.dtype` still wins), and a line saying which applies (on rank 0; "" outside accelerate launch)."""
    precision = environ.get("ACCELERATE_MIXED_PRECISION")
    if precision is None:
        return list(overrides), ""
    if precision not in ACCELERATE_DTYPES:
        raise GptforgeError(f"accelerate launch --mixed_precision {precision}: gptforge trains in no, bf16 or fp16")
    asked = f"accelerate launch --mixed_precision {precision}"
    explicit = [o for o in overrides if o.partition("=")[0].strip() == "train.dtype"]
    note = (
        f"{asked}: --set {explicit[-1]} takes precedence"
        if explicit
        else f"{asked}: train.dtype={ACCELERATE_DTYPES[precision]}"
    )
    return [f"train.dtype={ACCELERATE_DTYPES[precision]}", *overrides], note if launch_env(environ).is_main else ""


def elastic_resume(resume: str | None, environ: Mapping[str, str], saved: bool) -> tuple[str | None, str]:
    """`--resume` as given, or "auto" when torchrun restarted the job (`--max-restarts`: a worker had died), so that
    it continues from its newest checkpoint on its own (a checkpoint given to --resume only while the run has
    `saved` none of its own); and a line saying so (on rank 0; "" otherwise)."""
    attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt == 0 or resume not in (None, "auto") and not saved:
        return resume, ""
    note = f"torchrun restarted the job (restart {attempt}): continuing from the newest checkpoint (--resume auto)"
    return "auto", note if launch_env(environ).is_main else ""


def elastic_warning(environ: Mapping[str, str]) -> str:
    """A line (rank 0) for `torchrun --max-restarts` over several nodes with torchrun's shared store: their agents
    count restarts apart, so a restarted group cannot be told from the one before (pytorch#167288)."""
    several = int(environ.get("GROUP_WORLD_SIZE") or 1) > 1 and int(environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0
    if not several or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not launch_env(environ).is_main:
        return ""
    return (
        "torchrun --max-restarts over several nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where torchrun runs, "
        "or a restarted job may fail to connect (torch keeps one store for all restarts)"
    )


# How gloo (and nccl in blocking mode) word a peer that did not answer in time, and one that went away.
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_LOST = re.compile(r"connection (reset|closed)|closed by peer|broken pipe", re.IGNORECASE)
_PACKAGE = str(Path(__file__).parents[1])


@contextlib.contextmanager
def peer_failures(env: DistEnv, timeout: float) -> Iterator[None]:
    """Turn a collective's RuntimeError for a peer that timed out or went away into a one-line GptforgeError."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        timed_out = bool(_TIMED_OUT.search(text))
        if not env.distributed or not (timed_out or _LOST.search(text)):
            raise
        where = waiting_in(traceback.extract_tb(e.__traceback__))
        # gloo's first sentence, less the source file and line it starts with
        detail = re.sub(r"^\[[^\]]*\] *", "", text.splitlines()[0]).split(". ")[0]
        if timed_out:
            why = f"timed out: a peer rank did not respond within train.dist_timeout={timeout:g}s (stalled or dead)"
        else:
            why = "failed: a peer rank closed its connection (it exited)"
        raise GptforgeError(f"rank {env.rank}: {where} {why}; see the other ranks' output [{detail}]") from e


def waiting_in(frames: list[traceback.FrameSummary]) -> str:
    """What a stack (or traceback) is blocked in, and the gptforge function above the helpers here that called it:
    'all_reduce in stop_vote'."""
    innermost = frames[-1]
    what = "backward (DDP's gradient all-reduce)" if "autograd" in innermost.filename else innermost.name
    ours = (f.name for f in reversed(frames) if f.filename.startswith(_PACKAGE) and f.filename != __file__)
    caller = next(ours, None)
    return f"{what} in {caller}" if caller else what


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
