"""The run folder's files other than checkpoints, and reading them back (report, plot, and later serve).

RUN_DIR/config.toml (resolved config), metrics.jsonl (one JSON object per event), samples.jsonl (text samples),
checkpoints/ (see checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError
from gptforge.files import read_jsonl

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"


def read_metrics(run_dir: str | Path, kinds: tuple[str, ...] = ("train", "val", "hellaswag")) -> dict[str, list[dict]]:
    """A run's metrics.jsonl records grouped by kind, in file order (a line torn by a crash at the end is skipped)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise GptforgeError(f"{run_dir}: no {METRICS} (expected a folder written by `gptforge train`)")
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for _, record in read_jsonl(path, torn_tail_ok=True):
        if isinstance(record, dict) and record.get("kind") in by_kind:
            by_kind[record["kind"]].append(record)
    return by_kind


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
