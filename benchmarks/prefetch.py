"""Time the training loop waits for data, with and without the prefetch thread, reading from a cold page cache.

python benchmarks/prefetch.py [--tokens 800_000_000] [--compute-ms 30] [--batches 200]

Writes --tokens random uint16 tokens as shards, then for each mode drops the page cache (root only; otherwise
the second mode reads warm data and the comparison says so) and runs --batches micro-steps of 64 x 1024 windows,
each followed by --compute-ms of simulated device work that releases the GIL, as waiting on a GPU does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from gptforge.data.loader import TokenLoader
from gptforge.data.prefetch import Prefetcher
from gptforge.data.shards import write_manifest, write_shard

SHARD = 100_000_000


def make_shards(root: Path, tokens: int) -> None:
    rng = np.random.default_rng(0)
    shards = []
    for i in range(0, tokens, SHARD):
        n = min(SHARD, tokens - i)
        write_shard(root / f"train_{i // SHARD:06d}.bin", rng.integers(0, 50257, n, dtype=np.uint16))
        shards.append({"file": f"train_{i // SHARD:06d}.bin", "split": "train", "tokens": n})
    split = {"docs": 1, "tokens": tokens, "bytes": tokens}
    write_manifest(
        root,
        {
            "tokenizer": {"name": "gpt2", "vocab_size": 50257, "eot": 50256},
            "shards": shards,
            "splits": {"train": split},
        },
    )


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(root: Path, prefetch: bool, batches: int, compute_s: float) -> tuple[float, float]:
    """(seconds waiting for data per micro-step: median, total) over `batches` micro-steps."""
    loader = TokenLoader(root, "train", 64, 1024, seed=1)
    source = Prefetcher(loader) if prefetch else loader
    waits = []
    for _ in range(batches):
        t = time.perf_counter()
        source.next_batch()
        waits.append(time.perf_counter() - t)
        time.sleep(compute_s)
    if prefetch:
        source.close()
    return statistics.median(waits), sum(waits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=800_000_000)
    p.add_argument("--compute-ms", type=float, default=30.0)
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        make_shards(Path(tmp), args.tokens)
        results = {}
        for prefetch in (False, True):
            cold = drop_page_cache()
            median, total = run(Path(tmp), prefetch, args.batches, args.compute_ms / 1000)
            results[prefetch] = total
            print(
                f"{'prefetch thread' if prefetch else 'inline loader  '}: waits {median * 1000:6.2f} ms median, "
                f"{total:6.2f} s in all over {args.batches} micro-steps of 64 x 1024 "
                f"({'cold' if cold else 'warm: could not drop the'} page cache)"
            )
        print(f"data wait removed: {1 - results[True] / results[False]:.0%}")


if __name__ == "__main__":
    main()
