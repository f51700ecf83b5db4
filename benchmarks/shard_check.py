"""Does verifying shard checksums delay training? Time to the first batch and to 100 batches, with and without.

python benchmarks/shard_check.py [--tokens 200_000_000]

Writes --tokens random tokens as 100M-token shards twice: once with the sha256 `gptforge prepare` records (the
loader then hashes each shard on a background thread), once without (no check), and times the same reads.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gptforge.data import shards
from gptforge.data.loader import TokenLoader
from gptforge.data.shards import write_manifest, write_shard

SHARD = 100_000_000


def make(root: Path, tokens: int, checksums: bool) -> None:
    rng, shards = np.random.default_rng(0), []
    for i in range(0, tokens, SHARD):
        n, name = min(SHARD, tokens - i), f"train_{i // SHARD:06d}.bin"
        sha = write_shard(root / name, rng.integers(0, 50257, n, dtype=np.uint16))
        shards.append({"file": name, "split": "train", "tokens": n, **({"sha256": sha} if checksums else {})})
    split = {"docs": 1, "tokens": tokens, "bytes": tokens}
    manifest = {"tokenizer": {"name": "gpt2", "vocab_size": 50257, "eot": 50256}, "shards": shards}
    write_manifest(root, {**manifest, "splits": {"train": split}})


def run(root: Path) -> tuple[float, float, float]:
    shards._verified.clear()  # each run hashes afresh, as a new training process does
    t0 = time.perf_counter()
    loader = TokenLoader(root, "train", 64, 1024, seed=0)
    loader.next_batch()
    first = time.perf_counter() - t0
    for _ in range(99):
        loader.next_batch()
    hundred = time.perf_counter() - t0
    loader.verify()
    return first, hundred, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=200_000_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"no check": Path(tmp) / "off", "checksums": Path(tmp) / "on"}
        for name, root in roots.items():
            root.mkdir()
            make(root, args.tokens, checksums=name == "checksums")
        results = {name: [run(root) for _ in range(3)] for name, root in roots.items()}  # warm cache after run 1
    print(f"{args.tokens:,} tokens in {SHARD:,}-token shards, 64 x 1024 windows per batch, median of 3")
    print(f"{'':>10} {'first batch':>12} {'100 batches':>12} {'all checked':>12}")
    for name, runs in results.items():
        first, hundred, done = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{name:>10} {first * 1000:>10.1f}ms {hundred * 1000:>10.0f}ms {done * 1000:>10.0f}ms")
    off, on = (statistics.median(r[1] for r in results[k]) for k in ("no check", "checksums"))
    print(f"100 batches with checksums take {on / off:.2f}x the time without")


if __name__ == "__main__":
    main()
