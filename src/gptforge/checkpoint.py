"""Checkpoints: RUN_DIR/checkpoints/step_NNNNNN/{model.safetensors, optimizer.pt, meta.json}.

Written into a temporary folder and renamed into place, so a crash mid-write never leaves a partial
checkpoint where `latest_checkpoint` would find it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from gptforge.config import Config, config_from_dict, to_dict
from gptforge.errors import GptforgeError
from gptforge.model import GPT
from gptforge.tokenizer import Tokenizer, load_tokenizer

META = "meta.json"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: GPT,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    tokenizer: Tokenizer,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write RUN_DIR/checkpoints/step_NNNNNN atomically and return it."""
    folder = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    return write_checkpoint(folder, model, optimizer, cfg, tokenizer, {"step": step, **(extra or {})})


def write_checkpoint(
    final: Path,
    model: GPT,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    tokenizer: Tokenizer,
    meta: dict[str, Any],
) -> Path:
    """Write a complete checkpoint into a temporary folder, then rename it to `final`."""
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))  # de-duplicates the tied embedding
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if tokenizer.path is not None:
        shutil.copyfile(tokenizer.path, tmp / tokenizer.name)  # checkpoints are self-contained
    meta = {**meta, "config": to_dict(cfg), "tokenizer": tokenizer.name}
    (tmp / META).write_text(json.dumps(meta, indent=2))
    if final.exists():
        old = final.with_name(f".{final.name}.old.{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    ckpts = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / META).is_file())
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (meaning its newest checkpoint)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise GptforgeError(
            f"{path}: not a checkpoint (expected a folder with {META}, or a run folder with checkpoints/)"
        )
    return latest


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[GPT, Tokenizer, Config, dict[str, Any]]:
    """Model (eval mode, on `device`), its tokenizer, config and meta from a checkpoint or run folder."""
    ckpt = resolve_checkpoint(path)
    try:
        meta = json.loads((ckpt / META).read_text())
        cfg = config_from_dict(meta["config"])
    except (json.JSONDecodeError, KeyError) as e:
        raise GptforgeError(f"{ckpt / META}: malformed checkpoint metadata ({e})") from None
    model = GPT(cfg.model)
    load_model(model, str(ckpt / "model.safetensors"), device=str(device))
    return model.to(device).eval(), load_tokenizer(meta["tokenizer"], ckpt), cfg, meta


def restore_training_state(
    ckpt: Path, model: GPT, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, Any]:
    """Load weights and optimizer state into a freshly built model/optimizer; returns the checkpoint's meta."""
    load_model(model, str(ckpt / "model.safetensors"), device=str(device))
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device, weights_only=True))
    return json.loads((ckpt / META).read_text())
