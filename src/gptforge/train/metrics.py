"""Logging a run: one JSON object per event appended to RUN_DIR/metrics.jsonl, and TensorBoard / W&B sinks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError, first_detail
from gptforge.files import to_json
from gptforge.rundir import METRICS


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
            try:
                self._wandb = wandb.init(project=wandb_project, name=run_dir.name, dir=str(run_dir), config=config)
            except Exception as e:  # wandb raises its own types for a missing login, a network failure, ...
                self.close(failed=True)
                raise GptforgeError(
                    f"log.wandb={wandb_project}: W&B could not start ({first_detail(e)}); run `wandb login`, "
                    "or set WANDB_MODE=offline to log locally and `wandb sync` later"
                ) from None

    def write(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
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


class NullLog:
    """What ranks other than 0 log to."""

    def write(self, kind: str, step: int, **values: Any) -> None:
        pass

    def __enter__(self) -> NullLog:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
