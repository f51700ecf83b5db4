"""The run folder's files other than checkpoints, and reading them back (report, plot, and later serve).

RUN_DIR/config.toml (resolved config), metrics.jsonl (one JSON object per event), samples.jsonl (text samples),
checkpoints/ (see checkpoint.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError
from gptforge.files import METRICS
from gptforge.inputs import read_jsonl

CONFIG = "config.toml"
SAMPLES = "samples.jsonl"


# What gptforge train writes in every record of a kind (a value may be null where it was not finite).
FIELDS = {
    "train": ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "time"),
    "val": ("loss", "ppl", "bpb"),
    "hellaswag": ("acc_norm_token", "n"),
    "code": ("cases", "prefix_exact", "parse_rate"),
    "rl": ("reward", "pass_rate", "reply_tokens", "kl", "time"),
    "tasks": ("pass@1", "tasks"),
}
COUNTED = ("tokens", "time", "n", "cases", "tasks")  # always finite: never null


def finite_number(value: Any) -> bool:
    """A number that is not NaN or infinite and fits a float (JSON's integers have no bound, Python's json reads
    NaN and Infinity)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and -sys.float_info.max <= value <= sys.float_info.max


def _number(value: Any, counted: bool) -> bool:
    if counted:
        return finite_number(value)
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


# Names older runs wrote, read under today's: HellaSwag's per-token acc_norm, named so since lm-eval's is per character.
OLD_NAMES = {"hellaswag": {"acc_norm": "acc_norm_token"}}


def read_metrics(
    run_dir: str | Path, kinds: tuple[str, ...] = ("train", "val", "hellaswag", "code")
) -> dict[str, list[dict]]:
    """A run's metrics.jsonl records grouped by kind, in file order (a line torn by a crash at the end is skipped)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise GptforgeError(f"{run_dir}: no {METRICS} (expected a folder written by `gptforge train`)")
    records: list[dict[str, Any]] = []
    for where, record in read_jsonl(path, torn_tail_ok=True):
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):  # JSON's true is Python's 1
            raise GptforgeError(f"{where}: expected a JSON object with an integer 'step'")
        if not isinstance(record.get("kind"), str):  # none, or a list or object: no kind a reader draws
            continue
        for old, new in OLD_NAMES.get(record.get("kind"), {}).items():
            if old in record and new not in record:
                record[new] = record.pop(old)
        missing = [k for k in FIELDS.get(record.get("kind"), ()) if k not in record]
        if missing:
            raise GptforgeError(f"{where}: a {record['kind']} record without {missing} (not written by gptforge train)")
        wrong = [k for k in FIELDS.get(record.get("kind"), ()) if not _number(record[k], k in COUNTED)]
        if wrong:
            raise GptforgeError(
                f"{where}: a {record['kind']} record whose {wrong} is not a number (not written by gptforge train)"
            )
        if record.get("kind") == "resume":  # the steps an interrupted attempt logged past the checkpoint are redone
            records = [r for r in records if r["step"] < record["step"] or (r["step"] == record["step"] > 0)]
        records.append(record)
    return {kind: [r for r in records if r.get("kind") == kind] for kind in kinds}


def val_sources(records: list[dict]) -> list[str]:
    """The folders of a mix whose val numbers `records` carry (as `loss/NAME`, `bpb/NAME`), in the order logged."""
    names = {key[5:]: None for record in records for key in record if key.startswith("loss/")}
    return list(names)


def finite(records: list[dict], key: str) -> list[dict]:
    """The records whose `key` is a finite number (a diverged step logs null)."""
    return [r for r in records if finite_number(r.get(key))]


def format_duration(seconds: float) -> str:
    if not finite_number(seconds):  # the difference of two times, each near a float's limit
        return "n/a"
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
