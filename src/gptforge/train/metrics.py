"""Logging a run: one JSON object per event appended to RUN_DIR/metrics.jsonl, and TensorBoard / W&B sinks."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError, first_detail
from gptforge.files import atomic_write, cut_torn_tail, to_json, writing
from gptforge.rundir import METRICS


class MetricsLog:
    """Append-only JSONL log ({"kind", "step", "time", ...values}, flushed per line), mirrored to the sinks."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb_project: str = "", config: dict | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._path = run_dir / METRICS
        cut_torn_tail(self._path)  # a resume appends: never onto a line a crash tore
        self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
        self._tb = self._wandb = None
        try:
            self._tb = _open_tensorboard(run_dir, config) if tensorboard else None
            self._wandb = _open_wandb(run_dir, wandb_project, config) if wandb_project else None
        except GptforgeError:
            self.close(failed=True)
            raise

    def write(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        with writing(self._path):
            self._file.write(to_json(record) + "\n")
            self._file.flush()
        numbers = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self, failed: bool = False) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)  # a run that raised shows as failed, not finished

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


WANDB_ID = "wandb_id"
"""RUN_DIR/wandb_id: the W&B run a resumed run goes on logging to."""


def _open_tensorboard(run_dir: Path, config: dict | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise GptforgeError("log.tensorboard=true needs the tensorboard package (pip install tensorboard)") from None
    writer = SummaryWriter(str(run_dir / "tensorboard"))
    if config:  # TensorBoard's Text tab shows the settings beside the curves
        writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")
    return writer


def _open_wandb(run_dir: Path, project: str, config: dict | None):
    """The run's W&B run: a new one, or on resume the one it started (its id is kept in RUN_DIR/wandb_id)."""
    try:
        import wandb
    except ImportError:
        raise GptforgeError("log.wandb needs the wandb package (pip install wandb)") from None
    id_file = run_dir / WANDB_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    try:
        run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config, id=run_id, resume="allow")
    except Exception as e:  # wandb raises its own types for a missing login, a network failure, ...
        raise GptforgeError(
            f"log.wandb={project}: W&B could not start ({first_detail(e)}); run `wandb login`, "
            "or set WANDB_MODE=offline to log locally and `wandb sync` later"
        ) from None
    atomic_write(id_file, run_id)
    return run


class NullLog:
    """What ranks other than 0 log to."""

    def write(self, kind: str, step: int, **values: Any) -> None:
        pass

    def __enter__(self) -> NullLog:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
