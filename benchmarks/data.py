"""Data pipeline throughput: stdlib tokenization (MB/s) with 1 worker and all cores, and loader batches/s.

Also the parent process's CPU time per document on many small documents (the stdlib cut into 600-character
JSONL records, FineWeb-sized): the parent hands out and collects every document, so this caps how many
workers can be kept busy.

python benchmarks/data.py [--tokenizer gpt2] [--batch 16] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from gptforge.data.loader import TokenLoader
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.sources import stdlib_documents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in sorted({1, cores}):
            out = Path(tmp) / f"w{workers}"
            t = time.perf_counter()
            m = prepare(PrepareSettings.from_flags("stdlib", tokenizer=args.tokenizer), out, workers=workers)
            seconds = time.perf_counter() - t
            mb = sum(s["bytes"] for s in m["splits"].values()) / 1e6
            tokens = sum(s["tokens"] for s in m["splits"].values())
            rates[workers] = mb / seconds
            print(
                f"prepare stdlib, {workers} worker(s): {mb:.1f} MB, {tokens:,} tokens in {seconds:.1f}s "
                f"= {rates[workers]:.1f} MB/s, {tokens / seconds / 1e6:.2f}M tokens/s"
            )
        if cores > 1:
            print(f"speed-up with {cores} workers: {rates[cores] / rates[1]:.2f}x")
        small = Path(tmp) / "small.jsonl"
        with small.open("w") as f:
            for _name, text in stdlib_documents():
                f.writelines(json.dumps({"text": text[i : i + 600]}) + "\n" for i in range(0, len(text), 600))
        t, cpu = time.perf_counter(), time.process_time()
        m = prepare(
            PrepareSettings.from_flags(str(small), tokenizer=args.tokenizer), Path(tmp) / "small", workers=cores
        )
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
        docs = sum(s["docs"] for s in m["splits"].values())
        print(
            f"prepare {docs:,} documents of 600 characters, {cores} worker(s): {seconds:.1f}s, parent process "
            f"{cpu / docs * 1e6:.0f} us CPU per document (caps the pool at {docs / cpu:,.0f} documents/s)"
        )
        loader = TokenLoader(out, "train", args.batch, args.seq_len, seed=0)
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 3.0:
            loader.next_batch()
            n += 1
        rate = n / (time.perf_counter() - t)
        print(
            f"loader: {rate:,.0f} batches/s of {args.batch} x {args.seq_len} "
            f"= {rate * args.batch * args.seq_len / 1e6:.1f}M tokens/s (shuffled windows, memory-mapped)"
        )


if __name__ == "__main__":
    main()
