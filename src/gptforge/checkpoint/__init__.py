"""Checkpoints: RUN_DIR/checkpoints/step_NNNNNN/{model.safetensors, optimizer.pt | shards/, meta.json, rng_rankR.pt}.

Written into a temporary folder and renamed into place, so a crash mid-write never leaves a partial
checkpoint where `latest_checkpoint` would find it. Rank 0 writes the shared state (an fsdp run: each rank its
shards); every rank adds its own RNG state (for multi-node runs the run folder must be on a shared filesystem).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model

from gptforge.checkpoint.integrity import checksum_problem
from gptforge.checkpoint.layout import META, SHARDS, checkpoints, latest_checkpoint, read_meta, sharded, step_of
from gptforge.checkpoint.save import (
    Saving,
    begin_checkpoint,
    end_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    set_rng_state,
    weights_finite,
    write_checkpoint,
)
from gptforge.config import Config, config_from_dict, lora_spec
from gptforge.errors import GptforgeError, first_detail
from gptforge.inputs import utf8_path
from gptforge.model.engine import FLOAT_ROWS, Decoding, column_major
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.lora import apply_lora, merge_lora
from gptforge.model.quantize import quantize_int8
from gptforge.runtime.device import resolve_device, resolve_dtype
from gptforge.runtime.distributed import SINGLE, DistEnv, launch_env
from gptforge.runtime.fsdp import (
    is_sharded,
    load_shard_weights,
    load_shards,
    load_whole_state,
    optimizer_names,
    shard_shapes,
    shards_problem,
    state_by_index,
    state_by_name,
)
from gptforge.tokens.chat import model_tokenizer
from gptforge.tokens.tokenizer import Tokenizer, load_tokenizer

# The package's face: reading here, writing in save.py, the folder layout in layout.py.
__all__ = [
    "META",
    "SHARDS",
    "Inference",
    "Saving",
    "begin_checkpoint",
    "checkpoint_problem",
    "checkpoints",
    "end_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_for_inference",
    "prune_checkpoints",
    "quiet_model",
    "read_meta",
    "resolve_checkpoint",
    "restore_training_state",
    "save_checkpoint",
    "set_rng_state",
    "sharded",
    "step_of",
    "weights_finite",
    "weights_misfit",
    "write_checkpoint",
]


def quiet_model(config: GPTConfig) -> GPT:
    """A GPT of `config` on the CPU built without drawing from torch's generator: a copy made mid-run (FSDP's
    gathered weights to evaluate, a checkpoint's to resume from) must leave the run's dropout stream as it was."""
    with torch.random.fork_rng(devices=[]):
        return GPT(config)


def checkpoint_problem(ckpt: Path, for_training: bool = False, checksums: bool = False) -> str | None:
    """Why a checkpoint folder cannot be loaded, or None. Cheap structural checks that catch what a full disk,
    a killed copy or a hand edit leaves (unreadable meta.json, truncated weights, a missing or cut optimizer); with
    `checksums`, also damage that kept the sizes (every file the load reads is hashed)."""
    special = _special_file(ckpt)
    if special:
        return special
    try:
        meta = json.loads((ckpt / META).read_text(encoding="utf-8"))
        config_from_dict(meta["config"])
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError, GptforgeError) as e:
        return f"{META} is unreadable or incomplete ({type(e).__name__}: {e})"
    weights = shards_problem(ckpt / SHARDS) if sharded(ckpt) else _safetensors_problem(ckpt / "model.safetensors")
    problem = _tokenizer_problem(ckpt, meta.get("tokenizer")) or weights
    if not problem and for_training and not sharded(ckpt):  # the shards hold the optimizer's state too
        problem = _optimizer_problem(ckpt)
    if not problem and checksums:
        problem = checksum_problem(ckpt, meta, for_training)
    return problem


def _special_file(ckpt: Path) -> str | None:
    """A FIFO, device or socket where a checkpoint's file goes: opening it would block (or never end), so it is
    named and never opened."""
    try:
        odd = next((p for p in ckpt.rglob("*") if not (p.is_file() or p.is_dir())), None)
    except OSError:  # pruned by training a moment ago: the checks below say what is missing
        return None
    return None if odd is None else f"{odd.relative_to(ckpt)} is not a regular file (a FIFO, device, socket, dead link)"


def _optimizer_problem(ckpt: Path) -> str | None:
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
        problem = checkpoint_problem(path, for_training, checksums=True)
        if problem:
            raise GptforgeError(f"{path}: damaged checkpoint: {problem}")
        return path
    ckpts = checkpoints(path) if path.is_dir() else []
    if not ckpts:
        raise GptforgeError(
            f"{path}: not a checkpoint (expected a folder with {META}, or a run folder with checkpoints/)"
        )
    for ckpt in reversed(ckpts):
        problem = checkpoint_problem(ckpt, for_training, checksums=True)
        if problem is None:
            return ckpt
        if launch_env(os.environ).is_main:  # under torchrun every process resolves it: one warning, not one each
            warnings.warn(f"{ckpt}: damaged checkpoint ({problem}); falling back to the previous one", stacklevel=2)
    raise GptforgeError(f"{path}: every checkpoint is damaged (the newest: {ckpts[-1]})")


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu", merge: bool = True
) -> tuple[GPT, Tokenizer, Config, dict[str, Any]]:
    """Model (eval mode, on `device`), its tokenizer, config and meta from a checkpoint or run folder; a LoRA
    run's adapters are folded into its weights unless `merge` is false."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"])
    model = GPT(cfg.model)
    adapters = lora_spec(cfg.train)
    if adapters is not None:  # a LoRA run saves its frozen base and its adapters; inference runs them merged
        apply_lora(model, adapters)
    _load_weights(model, ckpt, device)
    if adapters is not None and merge:
        merge_lora(model)
    tokenizer = model_tokenizer(load_tokenizer(meta["tokenizer"], ckpt), cfg.data.fim_rate, cfg.data.chat_template)
    return model.to(device).eval(), tokenizer, cfg, meta


def _saved_shapes(ckpt: Path) -> dict[str, list[int]] | None:
    """Each saved weight's shape by name, from the safetensors header or the shards' index (None: unreadable)."""
    if sharded(ckpt):
        return shard_shapes(ckpt / SHARDS)
    try:
        with utf8_path(ckpt / "model.safetensors") as file, safe_open(file, framework="pt") as f:
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
            with utf8_path(source) as file:
                load_model(model, file, device=str(device))
    except (RuntimeError, OSError, ValueError, pickle.UnpicklingError) as e:  # damaged: its first informative line
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
    decoding: Decoding = FLOAT_ROWS


def load_for_inference(
    path: str | Path, device: str = "auto", dtype: str = "auto", decoding: Decoding = FLOAT_ROWS
) -> Inference:
    """`dtype` 'auto' computes in the precision the checkpoint trained in (an import: the one it came in);
    `decoding.weights` int8 quantizes the linear layers (weight-only)."""
    dev = resolve_device(device, "--device")
    model, tok, cfg, meta = load_checkpoint(path, dev)
    if decoding.weights == "int8":
        quantize_int8(model)
    if dev.type == "cpu":
        column_major(model)
    compute = resolve_dtype(cfg.train.dtype if dtype == "auto" else dtype, dev)
    return Inference(model, tok, cfg, meta, dev, compute, decoding)


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
    if hasattr(optimizer, "consolidate_state_dict"):
        raise GptforgeError(
            f"{ckpt / SHARDS}: a sharded checkpoint resumes under train.parallel=fsdp, or ddp without train.zero "
            "(ZeRO's optimizer reads whole checkpoints only)"
        )
    try:
        load_shards(model, optimizer, ckpt / SHARDS)
    except Exception as e:  # noqa: BLE001 - whatever a process's read failed with: one line naming the folder
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
