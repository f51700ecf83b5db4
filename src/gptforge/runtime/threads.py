"""CPU threads per process, and a warning when the cores are too busy to train at their speed."""

from __future__ import annotations

import time

import torch

# Below this many matmul FLOP/s per thread a core is shared or throttled: an idle x86-64 or ARMv8 core of the last
# decade sustains several times more (this workplace's 2-core hosts measured 58-143 GFLOP/s a core in fp32).
BUSY_FLOPS_PER_THREAD = 10e9
# Below this, a process's threads share cores with other work: on an idle 2-core AMD EPYC two threads ran 512-square
# matmuls 1.9-2.0x as fast as one; beside one or two busy processes 0.6-0.75x, where training with one thread was
# 1.17-1.5x faster than with two (benchmarks/RESULTS.md, issue 24). So the default stays one thread per core, and
# a run on shared cores says so.
BUSY_SCALING = 1.2


def use_threads(requested: int) -> None:
    """Set this process's CPU threads to `requested` (train.threads, --threads; 0 leaves torch's count)."""
    if requested:
        torch.set_num_threads(requested)


def sustained_matmul_flops(threads: int, dtype: torch.dtype, n: int = 512, seconds: float = 0.25) -> float:
    """FLOP/s of back-to-back `n`-square matmuls on `threads` threads for `seconds` (contention shows in the total,
    where the fastest single matmul would hide it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)  # leave the training RNG alone
        a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
        a @ b  # warm-up
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            a @ b
            count += 1
        return 2 * n**3 * count / elapsed
    finally:
        torch.set_num_threads(before)


def slowed_by_load(peak: float) -> bool:
    """Whether a measured CPU matmul peak is far below what this process's threads give on idle cores."""
    return 0 < peak < BUSY_FLOPS_PER_THREAD * torch.get_num_threads()


def busy_warning(peak: float, dtype: torch.dtype) -> str | None:
    """A line when this process's threads share busy cores (several threads barely outrun one) or the measured
    matmul peak is far below an idle core's, else None."""
    threads = torch.get_num_threads()
    if threads > 1:
        scaling = sustained_matmul_flops(threads, dtype, seconds=0.1) / sustained_matmul_flops(1, dtype, seconds=0.1)
        if scaling < BUSY_SCALING:
            return (
                f"warning: {threads} threads ran matmuls {scaling:.2f}x as fast as one (about {threads}x on idle "
                "cores): other work shares these cores, so training will be slow; try train.threads=1 (--threads 1 "
                "for eval and sample), or a quieter machine"
            )
    if not slowed_by_load(peak):
        return None
    return (
        f"warning: matmuls ran at {peak / 1e9:.0f} GFLOP/s on {threads} thread{'s' if threads > 1 else ''}, far "
        f"below an idle core's (over {BUSY_FLOPS_PER_THREAD / 1e9:.0f} GFLOP/s each): the machine is busy or "
        "throttled, so training will be slow; try a quieter machine"
    )
