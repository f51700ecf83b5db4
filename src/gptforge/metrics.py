"""Run metrics: one JSON object per event in RUN_DIR/metrics.jsonl, optional TensorBoard / W&B sinks, and MFU."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from gptforge.errors import GptforgeError

# Dense bf16 peak FLOP/s per GPU (no sparsity), matched against torch.cuda.get_device_name().
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


class MetricsLog:
    """Append-only JSONL log ({"kind", "step", "time", ...values}, flushed per line), mirrored to the sinks."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb_project: str = "", config: dict | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
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


class NullLog:
    """What ranks other than 0 log to."""

    def write(self, kind: str, step: int, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def peak_flops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the figure comes from (override, GPU table, or a CPU matmul probe)."""
    if override > 0:
        return override, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():
            if key in name:
                return flops, f"{key} bf16 dense peak"
        return 0.0, f"unknown GPU {name!r}: set train.peak_flops"
    if device.type == "cpu":
        return cpu_matmul_flops(dtype), f"measured CPU {str(dtype)[6:]} matmul"
    return 0.0, f"no peak known for {device.type}: set train.peak_flops"


def cpu_matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of the fastest of a few square matmuls on this CPU: the practical peak MFU is measured against."""
    g = torch.Generator().manual_seed(0)  # leave the training RNG alone
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up
    fastest = float("inf")
    for _ in range(repeats):  # the fastest, since a shared machine's hiccups only ever slow a matmul down
        t = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - t)
    return 2 * n**3 / fastest
