"""Peak FLOP/s of one device, against which MFU is reported: a table of GPU datasheet figures, or a CPU probe."""

from __future__ import annotations

import time

import torch

from gptforge.runtime import dtype_name
from gptforge.runtime.threads import slowed_by_load

# Dense (no sparsity) tensor-core peaks in TFLOP/s from the vendors' datasheets: (bf16/fp16 with fp32 accumulation,
# tf32). Matched as substrings of the device name, first match wins: variants come before their family, since an
# "H100 PCIe" peaks 24% lower than the SXM part that a bare "H100" figure describes.
GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (756.0, 378.0),
    "H100 NVL": (835.0, 418.0),
    "H200 NVL": (835.0, 418.0),
    "GH200": (989.4, 494.7),
    "H200": (989.4, 494.7),
    "H100": (989.4, 494.7),
    "H800": (989.4, 494.7),
    "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0),
    "A800": (312.0, 156.0),
    "L40S": (362.1, 183.0),
    "L40": (181.0, 90.5),
    "L4": (121.0, 60.0),
    "RTX 6000 Ada": (364.2, 182.1),
    "RTX A6000": (154.8, 77.4),
    "A40": (149.7, 74.8),
    "A10": (125.0, 62.5),
    "RTX 4090": (165.2, 82.6),
    "RTX 3090": (71.0, 35.6),
    "V100": (125.0, 15.7),  # fp16 only; no tf32, so fp32 runs at the CUDA-core rate
    "T4": (65.0, 8.1),
    "MI300X": (1307.4, 653.7),
}


def peak_flops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> tuple[float, str]:
    """Peak FLOP/s of one device and where the figure comes from (override, GPU table, or a CPU matmul probe)."""
    if override > 0:
        return override, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, tf32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                if dtype == torch.float32:  # matmuls run in tf32 (setup_fast_math allows it)
                    return tf32 * 1e12, f"{key} tf32 dense peak"
                return half * 1e12, f"{key} {dtype_name(dtype)} dense peak"
        return 0.0, f"unknown GPU {name!r}: set train.peak_flops"
    if device.type == "cpu":
        return cpu_matmul_flops(dtype), f"measured CPU {dtype_name(dtype)} matmul"
    return 0.0, f"no peak known for {device.type}: set train.peak_flops"


def cpu_matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of the fastest square matmul in `seconds` of trying: the practical peak MFU is measured against."""
    g = torch.Generator().manual_seed(0)  # leave the training RNG alone
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up
    fastest, start = float("inf"), time.perf_counter()
    # The fastest, since a shared machine's hiccups only ever slow a matmul down; half a second outlasts most.
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - t)
    return 2 * n**3 / fastest


def format_flops(flops: float) -> str:
    """'257 GFLOP/s' or '989.4 TFLOP/s' (a CPU's peak no longer prints as '0.0 TFLOP/s')."""
    if flops <= 0:
        return "an unknown peak"
    return f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.0f} GFLOP/s"


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{mfu:.1%}"


class Utilisation:
    """MFU against a device's peak. A CPU peak probed while the machine was busy is too low: when a step beats it,
    the probe runs again (a few times at most) and the higher figure stays; what still exceeds it reads None, and
    so does every step while the peak is one that load slowed (a figure against it would mean nothing)."""

    REPROBES = 3

    def __init__(self, peak: float, device: torch.device, dtype: torch.dtype) -> None:
        self.peak, self.device, self.dtype, self.reprobes = peak, device, dtype, 0

    def __call__(self, flops_per_s: float) -> float | None:
        if self.peak <= 0:
            return None
        if flops_per_s > self.peak and self.device.type == "cpu" and self.reprobes < self.REPROBES:
            self.reprobes += 1
            self.peak = max(self.peak, cpu_matmul_flops(self.dtype))
        mfu = flops_per_s / self.peak
        return mfu if mfu <= 1.0 and not (self.device.type == "cpu" and slowed_by_load(self.peak)) else None
