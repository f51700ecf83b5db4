"""Where code runs: device and precision, glibc allocator tuning, process groups, peak FLOP/s for MFU."""

MAX_THREADS = 1024  # torch.set_num_threads(20000) aborts the process in libgomp, 100000 segfaults
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # here, not in device.py, so the CLI's flags need no torch import


def dtype_name(dtype: object) -> str:
    """'bfloat16' for torch.bfloat16: the name DTYPE_NAMES, configs and logs use."""
    return str(dtype).removeprefix("torch.")
