"""Where a checkpoint's files lie: RUN_DIR/checkpoints/step_NNNNNN/, its meta.json, whole files or shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

META = "meta.json"
SHARDS = "shards"  # an fsdp run's weights and optimizer state, one file per process (torch.distributed.checkpoint)


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


def read_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of a checkpoint that `resolve_checkpoint` found intact."""
    return json.loads((ckpt / META).read_text(encoding="utf-8"))


def sharded(ckpt: Path) -> bool:
    """Whether checkpoint `ckpt` holds its weights and optimizer as shards (an fsdp run's) rather than whole."""
    return (ckpt / SHARDS).is_dir()
