"""Writing checkpoints: into a temporary folder renamed into place once complete (under FSDP each process writes
its own shards, in the background if asked), pruning old ones, and the RNG state each rank saves."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_model

from gptforge.checkpoint.integrity import seal
from gptforge.checkpoint.layout import META, SHARDS, checkpoints, step_of
from gptforge.config import Config, to_dict
from gptforge.errors import GptforgeError
from gptforge.files import building_dir, swap_dir, temp_dir_for, temp_dir_path, usual_mode, write_json, writing
from gptforge.model.gpt import GPT
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_sum, barrier
from gptforge.runtime.fsdp import (
    is_sharded,
    save_shards,
    wait_writes,
)
from gptforge.tokens.tokenizer import Tokenizer


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    tokenizer: Tokenizer,
    extra: dict[str, Any] | None = None,
    env: DistEnv = SINGLE,
) -> Path:
    """Write RUN_DIR/checkpoints/step_NNNNNN atomically (every rank calls this) and return it."""
    saving = begin_checkpoint(run_dir, step, model, optimizer, cfg, tokenizer, extra=extra, env=env)
    return end_checkpoint(saving, env)


@dataclass
class Saving:
    """A checkpoint being written into `tmp`, renamed to `final` by `end_checkpoint` once complete."""

    final: Path
    tmp: Path
    writes: Any = None
    """The shards still being written in the background (torch's future), or None."""


def begin_checkpoint(
    run_dir: str | Path,
    step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    tokenizer: Tokenizer,
    *,
    extra: dict[str, Any] | None = None,
    env: DistEnv = SINGLE,
    background: Any = None,
) -> Saving:
    """Start writing checkpoint `step` (every rank calls this); under FSDP with a `background` process group the
    shards are staged in memory and written on a thread, so training goes on meanwhile."""
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    tmp = temp_dir_path(final)
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)  # a sharded (ZeRO) optimizer gathers its state on rank 0
    spread = is_sharded(model)  # FSDP: every process writes its own shards, no gathering
    optimizer_state = optimizer.state_dict() if optimizer is not None and env.is_main and not spread else None
    writes = None
    try:
        with writing(final):
            if env.is_main:
                meta = {"step": step, **(extra or {})}
                _write_files(temp_dir_for(final), None if spread else model, optimizer_state, cfg, tokenizer, meta)
            barrier(env)
            if spread:
                writes = save_shards(model, optimizer, tmp / SHARDS, background)
            torch.save(rng_state(), tmp / f"rng_rank{env.rank}.pt")
    except GptforgeError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back; the previous checkpoint stands
        raise
    return Saving(final, tmp, writes)


def end_checkpoint(saving: Saving, env: DistEnv = SINGLE) -> Path:
    """Wait for the background writes if any, then put the complete checkpoint in place (every rank calls this)."""
    try:
        with writing(saving.final):
            if saving.writes is not None:
                wait_writes(saving.writes)
        barrier(env)
        if env.is_main:  # every process's files are complete: their checksums go into meta.json
            with writing(saving.final):
                seal(saving.tmp)
    except GptforgeError:
        shutil.rmtree(saving.tmp, ignore_errors=True)
        raise
    if env.is_main:
        swap_dir(saving.tmp, saving.final)
    barrier(env)
    return saving.final


def write_checkpoint(
    final: Path,
    model: GPT,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    tokenizer: Tokenizer,
    meta: dict[str, Any],
) -> Path:
    """Write a complete single-process checkpoint (e.g. an import) into `final`, atomically."""
    with building_dir(final) as tmp:
        _write_files(tmp, model, optimizer.state_dict() if optimizer else None, cfg, tokenizer, meta)
        seal(tmp)
    return final


def _write_files(
    tmp: Path, model: GPT | None, optimizer_state: dict | None, cfg: Config, tokenizer: Tokenizer, meta: dict
) -> None:
    """The files of a checkpoint (the weights unless sharded), into a fresh folder that `swap_dir` puts in place."""
    if model is not None:
        save_model(model, str(tmp / "model.safetensors"))  # de-duplicates the tied embedding
        usual_mode(tmp / "model.safetensors")
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    if tokenizer.path is not None:
        shutil.copyfile(tokenizer.path, tmp / tokenizer.name)  # checkpoints are self-contained
    write_json(tmp / META, {**meta, "config": to_dict(cfg), "tokenizer": tokenizer.name})


def prune_checkpoints(
    run_dir: str | Path, keep_last: int, milestone_every: int, *, spare: Path | None = None
) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints, sparing steps that are multiples of milestone_every and
    `spare` (the run's last good checkpoint: newer ones saved amid skipped steps never push it out)."""
    if keep_last < 1:
        raise GptforgeError(f"checkpoint.keep_last={keep_last}: pruning keeps at least the newest checkpoint")
    ckpts, keep = checkpoints(run_dir), spare.resolve() if spare else None
    doomed = [
        p
        for p in ckpts[: max(0, len(ckpts) - keep_last)]
        if not (milestone_every and step_of(p) % milestone_every == 0) and p.resolve() != keep
    ]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def weights_finite(model: torch.nn.Module, env: DistEnv = SINGLE) -> bool:
    """Whether every weight is finite on every process (under fsdp each checks its own shards; every rank calls
    this): weights gone NaN must never replace a good checkpoint."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    bad = torch.stack([torch.isfinite(t).all() for t in local]).logical_not().sum()
    return int(all_reduce_sum(bad, env)) == 0


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout uses torch's), in a weights_only-loadable form."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
