"""Run metrics: one JSON object per event in RUN_DIR/metrics.jsonl (written and read here), TensorBoard / W&B sinks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError
from gptforge.files import read_jsonl

METRICS = "metrics.jsonl"


class MetricsLog:
    """Append-only JSONL log ({"kind", "step", "time", ...values}, flushed per line), mirrored to the sinks."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb_project: str = "", config: dict | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / METRICS, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise GptforgeError(
                    "log.tensorboard=true needs the tensorboard package (pip install tensorboard)"
                ) from None
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise GptforgeError("log.wandb needs the wandb package (pip install wandb)") from None
            self._wandb = wandb.init(project=wandb_project, name=run_dir.name, dir=str(run_dir), config=config)

    def write(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullLog:
    """What ranks other than 0 log to."""

    def write(self, kind: str, step: int, **values: Any) -> None:
        pass

    def __enter__(self) -> NullLog:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def read_metrics(run_dir: str | Path, kinds: tuple[str, ...] = ("train", "val", "hellaswag")) -> dict[str, list[dict]]:
    """A run's metrics.jsonl records grouped by kind, in file order."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise GptforgeError(f"{run_dir}: no {METRICS} (expected a folder written by `gptforge train`)")
    by_kind: dict[str, list[dict]] = {k: [] for k in kinds}
    for _, record in read_jsonl(path):
        if record.get("kind") in by_kind:
            by_kind[record["kind"]].append(record)
    return by_kind


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
