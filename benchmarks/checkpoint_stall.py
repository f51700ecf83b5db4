"""How long an fsdp training step waits for a checkpoint: written in step, or staged and written in the background.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_stall.py [--config gpt2-124m] [--set K=V ...]
                                                                           [--repeats 3] [--out DIR]

Builds the run as `gptforge train` does (train.parallel=fsdp), trains one step, then `--repeats` times: a save in
step (`save_checkpoint`), and a background save (`begin_checkpoint` with its own gloo group: the stall), one more
training step, and the wait for the writes that is left (`end_checkpoint`). Rank 0 prints the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gptforge.checkpoint import begin_checkpoint, end_checkpoint, save_checkpoint
from gptforge.config import load_config
from gptforge.runtime.distributed import init
from gptforge.tokens.tokenizer import load_tokenizer
from gptforge.train.setup import build
from gptforge.train.step import train_step

SMALL = ["train.micro_batch=1", "model.block_size=64", "train.batch_tokens=128", "train.dtype=float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt2-124m")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    args = parser.parse_args()
    env, device = init("cpu", 600)
    cfg = load_config(args.config, ["train.parallel=fsdp", *SMALL, *args.set])
    s = build(cfg, env, torch.device(device))
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.block_size + 1))

    def step() -> None:
        batch = (tokens[:, :-1], tokens[:, 1:])
        train_step(s.train_model, s.model, s.optimizer, s.scaler, lambda: batch, s.grad_accum, 1.0, s.dtype, env)

    step()
    group, tokenizer = dist.new_group(backend="gloo"), load_tokenizer("gpt2")
    root = Path(args.out or tempfile.mkdtemp(prefix="stall-"))
    timings: dict[str, list[float]] = {"in_step": [], "background_stall": [], "left_after_a_step": []}
    for i in range(args.repeats):
        t = time.perf_counter()
        save_checkpoint(root / "sync", i, s.model, s.optimizer, cfg, tokenizer, env=env)
        timings["in_step"].append(time.perf_counter() - t)
        t = time.perf_counter()
        saving = begin_checkpoint(root / "async", i, s.model, s.optimizer, cfg, tokenizer, env=env, background=group)
        timings["background_stall"].append(time.perf_counter() - t)
        step()
        t = time.perf_counter()
        end_checkpoint(saving, env)
        timings["left_after_a_step"].append(time.perf_counter() - t)
    if env.is_main:
        medians = {k: statistics.median(v) for k, v in timings.items()}
        params = sum(p.numel() for p in s.model.parameters())
        print(json.dumps({"config": args.config, "params": params, "processes": env.world_size, **medians}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
