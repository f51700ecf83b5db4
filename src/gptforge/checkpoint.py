"""Checkpoints: RUN_DIR/checkpoints/step_NNNNNN/{model.safetensors, optimizer.pt, meta.json, rng_rankR.pt}.

Written into a temporary folder and renamed into place, so a crash mid-write never leaves a partial
checkpoint where `latest_checkpoint` would find it. Rank 0 writes the shared state; every rank adds its
own RNG state (for multi-node runs the run folder must be on a shared filesystem).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from gptforge.config import Config, config_from_dict, to_dict
from gptforge.data.fim import with_fim
from gptforge.data.tokenizer import Tokenizer, load_tokenizer
from gptforge.errors import GptforgeError, first_detail
from gptforge.files import building_dir, swap_dir, temp_dir_for, temp_dir_path, usual_mode, write_json, writing
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.runtime.device import resolve_device, resolve_dtype
from gptforge.runtime.distributed import SINGLE, DistEnv, barrier
from gptforge.runtime.fsdp import (
    is_sharded,
    load_shard_weights,
    load_shards,
    load_whole_state,
    optimizer_names,
    save_shards,
    shard_shapes,
    shards_problem,
    state_by_index,
    state_by_name,
)

META = "meta.json"
SHARDS = "shards"  # an fsdp run's weights and optimizer state, one file per process (torch.distributed.checkpoint)


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
                saving.writes.result()
    except GptforgeError:
        shutil.rmtree(saving.tmp, ignore_errors=True)
        raise
    barrier(env)
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
    return final


def quiet_model(config: GPTConfig) -> GPT:
    """A GPT of `config` on the CPU built without drawing from torch's generator: a copy made mid-run (FSDP's
    gathered weights to evaluate, a checkpoint's to resume from) must leave the run's dropout stream as it was."""
    with torch.random.fork_rng(devices=[]):
        return GPT(config)


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


def prune_checkpoints(run_dir: str | Path, keep_last: int, milestone_every: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints, sparing steps that are multiples of milestone_every."""
    if keep_last < 1:
        raise GptforgeError(f"checkpoint.keep_last={keep_last}: pruning keeps at least the newest checkpoint")
    ckpts = checkpoints(run_dir)
    doomed = [
        p
        for p in ckpts[: max(0, len(ckpts) - keep_last)]
        if not (milestone_every and step_of(p) % milestone_every == 0)
    ]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


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


def step_of(ckpt: Path) -> int:
    """The step in a checkpoint folder's name (step_NNNNNN; more digits past step 999,999), or -1."""
    digits = ckpt.name[len("step_") :]
    return int(digits) if ckpt.name.startswith("step_") and digits.isdigit() else -1


def checkpoints(run_dir: str | Path) -> list[Path]:
    """A run's complete checkpoints, oldest first by step number (names sort wrongly past step 999,999)."""
    found = [p for p in (Path(run_dir) / "checkpoints").glob("step_*") if step_of(p) >= 0 and (p / META).is_file()]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    ckpts = checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def checkpoint_problem(ckpt: Path, for_training: bool = False) -> str | None:
    """Why a checkpoint folder cannot be loaded, or None. Cheap structural checks that catch what a full disk,
    a killed copy or a hand edit leaves: unreadable meta.json, truncated weights, a missing or cut optimizer."""
    try:
        meta = json.loads((ckpt / META).read_text(encoding="utf-8"))
        config_from_dict(meta["config"])
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError, GptforgeError) as e:
        return f"{META} is unreadable or incomplete ({type(e).__name__}: {e})"
    weights = shards_problem(ckpt / SHARDS) if sharded(ckpt) else _safetensors_problem(ckpt / "model.safetensors")
    problem = _tokenizer_problem(ckpt, meta.get("tokenizer")) or weights
    if problem or not for_training or sharded(ckpt):  # the shards hold the optimizer's state too
        return problem
    if not (ckpt / "optimizer.pt").is_file():
        return "no optimizer.pt: not a training checkpoint (start from its weights with train.init_from)"
    if not zipfile.is_zipfile(ckpt / "optimizer.pt"):
        return "optimizer.pt is truncated or not a torch file"
    return None


def _tokenizer_problem(ckpt: Path, name: Any) -> str | None:
    """A checkpoint's tokenizer is 'gpt2' or a file in its own folder, named without a path: never one elsewhere."""
    if name == "gpt2":
        return None
    if not isinstance(name, str) or Path(name).name != name:
        return f"{META} names tokenizer {name!r}: expected 'gpt2' or the name of a tokenizer file in the checkpoint"
    if not (ckpt / name).is_file():
        return f"{name}, the tokenizer its {META} names, is missing"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then exactly the bytes it describes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:  # random bytes: never read a length the file cannot hold
                return f"{path.name} is unreadable (not a safetensors file)"
            header = json.loads(f.read(n))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        end = max(ends, default=0)
        if not all(isinstance(e, int) for e in ends):
            raise ValueError("data_offsets are not integers")
    except Exception as e:  # noqa: BLE001 - whatever the bytes are, the answer is "unreadable"
        return f"{path.name} is unreadable ({type(e).__name__}: {first_detail(e)})"
    if size != 8 + n + end:
        return f"{path.name} is truncated or padded ({size:,} bytes, expected {8 + n + end:,})"
    return None


def resolve_checkpoint(path: str | Path, for_training: bool = False) -> Path:
    """A checkpoint folder, or a run folder (meaning its newest intact checkpoint: a damaged newer one is skipped
    with a warning). A named checkpoint that is damaged is an error."""
    path = Path(path)
    if (path / META).exists():
        problem = checkpoint_problem(path, for_training)
        if problem:
            raise GptforgeError(f"{path}: damaged checkpoint: {problem}")
        return path
    ckpts = checkpoints(path) if path.is_dir() else []
    if not ckpts:
        raise GptforgeError(
            f"{path}: not a checkpoint (expected a folder with {META}, or a run folder with checkpoints/)"
        )
    for ckpt in reversed(ckpts):
        problem = checkpoint_problem(ckpt, for_training)
        if problem is None:
            return ckpt
        warnings.warn(f"{ckpt}: damaged checkpoint ({problem}); falling back to the previous one", stacklevel=2)
    raise GptforgeError(f"{path}: every checkpoint is damaged (the newest: {ckpts[-1]})")


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[GPT, Tokenizer, Config, dict[str, Any]]:
    """Model (eval mode, on `device`), its tokenizer, config and meta from a checkpoint or run folder."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"])
    model = GPT(cfg.model)
    _load_weights(model, ckpt, device)
    tokenizer = with_fim(load_tokenizer(meta["tokenizer"], ckpt), cfg.data.fim_rate)
    return model.to(device).eval(), tokenizer, cfg, meta


def read_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of a checkpoint that `resolve_checkpoint` found intact."""
    return json.loads((ckpt / META).read_text(encoding="utf-8"))


def sharded(ckpt: Path) -> bool:
    """Whether checkpoint `ckpt` holds its weights and optimizer as shards (an fsdp run's) rather than whole."""
    return (ckpt / SHARDS).is_dir()


def _saved_shapes(ckpt: Path) -> dict[str, list[int]] | None:
    """Each saved weight's shape by name, from the safetensors header or the shards' index (None: unreadable)."""
    if sharded(ckpt):
        return shard_shapes(ckpt / SHARDS)
    try:
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError):
        return None


def weights_misfit(model: GPT, ckpt: Path) -> str | None:
    """How the weights checkpoint `ckpt` holds differ from `model`'s in names and shapes (layers shown as h.*), or
    None; only the file's header or the shards' index is read."""
    saved = _saved_shapes(ckpt)
    if saved is None:
        return None  # unreadable: loading says so
    tied: dict[int, list[str]] = {}  # one entry per tensor, with all its names (the tied embedding has two)
    for name, tensor in model.state_dict(keep_vars=True).items():
        tied.setdefault(id(tensor), []).append(name)
    missing, unexpected, shapes = [], [], []
    for names in tied.values():
        found = [n for n in names if n in saved]
        missing += names[:1] if not found else []
        # A tied tensor saved twice: the file's model had them apart (the shards' index names every alias).
        unexpected += found[1:] if not sharded(ckpt) else []
        want = list(model.state_dict()[names[0]].shape)
        shapes += [f"{n} {saved[n]} in the file, {want} in the model" for n in found[:1] if saved[n] != want]
    known = {n for names in tied.values() for n in names}
    unexpected += [n for n in saved if n not in known]
    parts = (("missing", missing), ("unexpected", unexpected), ("shape of", shapes))
    return "; ".join(f"{what} {_names(found)}" for what, found in parts if found) or None


def _names(names: list[str], most: int = 4) -> str:
    """Tensor names with every layer's index as *, each once: the first `most`, and how many more."""
    unique = list(dict.fromkeys(re.sub(r"\.h\.\d+\.", ".h.*.", n) for n in names))
    return ", ".join(unique[:most] + ([f"{len(unique) - most} more"] if len(unique) > most else []))


def _load_weights(model: GPT, ckpt: Path, device: torch.device | str) -> None:
    """The checkpoint's weights into a whole `model` (placed on `device` when they are read whole)."""
    source = ckpt / (SHARDS if sharded(ckpt) else "model.safetensors")
    misfit = weights_misfit(model, ckpt)
    if misfit:
        raise GptforgeError(f"{source}: does not fit the model ({misfit})")
    try:
        if sharded(ckpt):
            load_shard_weights(model, source)
        else:
            load_model(model, str(source), device=str(device))
    except (RuntimeError, OSError, ValueError) as e:  # a damaged file: the first informative line says how
        raise GptforgeError(f"{source}: does not fit the model ({first_detail(e)})") from None


@dataclass
class Inference:
    """A checkpoint ready to evaluate or sample: the model in eval mode on `device`, and the dtype it trained in."""

    model: GPT
    tokenizer: Tokenizer
    cfg: Config
    meta: dict[str, Any]
    device: torch.device
    dtype: torch.dtype


def load_for_inference(path: str | Path, device: str = "auto", dtype: str = "auto") -> Inference:
    """`dtype` 'auto' computes in the precision the checkpoint trained in (an import: the one it came in)."""
    dev = resolve_device(device, "--device")
    model, tok, cfg, meta = load_checkpoint(path, dev)
    return Inference(model, tok, cfg, meta, dev, resolve_dtype(cfg.train.dtype if dtype == "auto" else dtype, dev))


def restore_training_state(
    ckpt: Path, model: GPT, optimizer: torch.optim.Optimizer, device: torch.device, env: DistEnv = SINGLE
) -> dict[str, Any]:
    """Load weights, optimizer and this rank's RNG state into a fresh model/optimizer; returns the meta."""
    if sharded(ckpt):
        _restore_shards(ckpt, model, optimizer)
    else:
        _restore_whole(ckpt, model, optimizer, device)
    rng = ckpt / f"rng_rank{env.rank}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=True))
    else:
        warnings.warn(f"{rng} is missing: resuming with fresh random state (dropout will differ)", stacklevel=2)
    return read_meta(ckpt)


def _restore_shards(ckpt: Path, model: GPT, optimizer: torch.optim.Optimizer) -> None:
    """A sharded checkpoint into a model sharded or whole, on any number of processes."""
    misfit = weights_misfit(model, ckpt)
    if misfit:
        raise GptforgeError(f"{ckpt / SHARDS}: does not fit the model ({misfit})")
    try:
        load_shards(model, optimizer, ckpt / SHARDS)
    except Exception as e:  # noqa: BLE001 - DCP wraps each process's failure in its own exception type
        raise GptforgeError(f"{ckpt / SHARDS}: cannot restore ({first_detail(e)})") from None


def _restore_whole(ckpt: Path, model: GPT, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """A checkpoint of whole files into a model sharded (every process reads them and keeps its shard) or whole."""
    spread = is_sharded(model)
    if spread:
        whole = quiet_model(model.config)
        _load_weights(whole, ckpt, "cpu")
    else:
        _load_weights(model, ckpt, device)
    try:
        state = torch.load(ckpt / "optimizer.pt", map_location="cpu" if spread else device, weights_only=True)
        names = optimizer_names(model, optimizer)
        if spread:
            load_whole_state(model, optimizer, whole.state_dict(), state_by_name(state, names))
        else:
            optimizer.load_state_dict(state_by_index(state, names))
    except (RuntimeError, ValueError, OSError, KeyError) as e:
        raise GptforgeError(f"{ckpt / 'optimizer.pt'}: cannot restore ({first_detail(e)})") from None
