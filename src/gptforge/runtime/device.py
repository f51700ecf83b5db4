"""Device and precision selection shared by training, evaluation and sampling."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from gptforge.errors import GptforgeError
from gptforge.runtime import DTYPE_NAMES
from gptforge.runtime.allocator import keep_freed_memory

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def resolve_device(name: str = "auto", flag: str = "train.device") -> torch.device:
    """auto picks cuda, then mps, then cpu; errors name `flag`, where the value came from."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps") or (device.type != "cuda" and device.index):
        raise GptforgeError(f"{flag}={name!r}: expected auto, cpu, cuda, cuda:N or mps")
    if device.index is not None and device.type != "cuda":  # cpu:0 is the cpu; safetensors refuses an index there
        device = torch.device(device.type)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GptforgeError(f"{flag}={name!r}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise GptforgeError(f"{flag}={name!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    mps = getattr(torch.backends, "mps", None)
    if device.type == "mps" and not (mps and mps.is_available()):
        raise GptforgeError(f"{flag}={name!r}: Apple MPS is not available on this machine")
    return device


def physical_memory() -> int | None:
    """This machine's RAM in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def cpu_has_native_bf16() -> bool:
    """oneDNN reports native bf16 (AVX512-BF16 / AMX) where bf16 matmuls beat fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_bf16_is_faster() -> bool:
    """Native bf16 that also measures faster than fp32: a 2-core Xeon reports it yet runs bf16 matmuls at 150
    GFLOP/s against fp32's 270, which made 'auto' train 1.36x slower there."""
    if not cpu_has_native_bf16():
        return False
    from gptforge.runtime.flops import cpu_matmul_flops

    return cpu_matmul_flops(torch.bfloat16, seconds=0.25) > cpu_matmul_flops(torch.float32, seconds=0.25)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and cpu_bf16_is_faster() else torch.float32
    if name not in DTYPES:
        raise GptforgeError(f"train.dtype={name!r}: expected one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision context; a no-op for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def setup_fast_math(device: torch.device) -> None:
    if device.type == "cpu":
        keep_freed_memory()  # a no-op after the first call (the CLI makes it before torch loads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
