"""What each part of the modern recipe contributes: modern-cpu with one component put back to GPT-2's at a time.

    python benchmarks/ablation.py --data data/stdlib --out runs/ablation [--steps 100 | --budget 120] [--seeds 1]

Each variant trains from the same seed(s) on the same corpus; the table gives the final validation bits per byte,
its change against the full recipe (positive: the component helps), and the median step time. With --steps the
comparison is per step (quality does not depend on the machine's load; the step time shows the cost); with --budget
it is per wall-clock second. demo-cpu (the GPT-2 recipe) runs alongside as the reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from gptforge.config import load_config
from gptforge.rundir import read_metrics
from gptforge.speedrun import read_curve
from gptforge.train.trainer import train

VARIANTS = {
    "modern (all)": [],
    "AdamW, not Muon": ["optim.optimizer=adamw"],
    "learned positions, not rotary": ["model.position=learned"],
    "no QK-norm": ["model.qk_norm=false"],
    "LayerNorm, not RMSNorm": ["model.norm=layernorm"],
    "GELU MLP, not ReLU²": ["model.mlp=gelu"],
    "SwiGLU MLP, not ReLU²": ["model.mlp=swiglu"],
    "untied embeddings": ["model.tie_embeddings=false"],
    "biases": ["model.bias=true"],
    "GPT-2 init, not zero-init": ["model.zero_init=false"],
    "cosine schedule, not WSD": ["optim.schedule=cosine", "optim.min_lr_ratio=0.1"],
}


def run_variant(name: str, preset: str, sets: list[str], args: argparse.Namespace, seed: int) -> dict:
    length = [f"train.max_steps={args.steps}", "train.time_budget=0"] if args.steps else [
        "train.max_steps=100000", f"train.time_budget={args.budget}"]  # fmt: skip
    shared = ["eval.every=0", "eval.tokens=32768", "eval.sample_tokens=0", "checkpoint.every=0", "log.every=25"]
    cfg = load_config(preset, [*sets, *length, *shared, *args.set, f"train.seed={seed}", f"data.path={args.data}"])
    run_dir = Path(args.out) / f"{name.split(',')[0].replace(' ', '-').replace('²', '2')}-seed{seed}"
    train(cfg, run_dir)
    curve = read_curve(run_dir)
    ms = [r["ms"] for r in read_metrics(run_dir)["train"][5:]]
    return {"variant": name, "seed": seed, "bpb": curve.final, "steps": curve.steps, "ms": statistics.median(ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--steps", type=int, default=0, help="fixed optimizer steps per run (else --budget)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds per run when --steps is 0")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="override for every variant, e.g. train.dtype=float32")
    p.add_argument("--only", default="", help="comma-separated variant numbers to run (0 = GPT-2 reference)")
    args = p.parse_args()
    names = ["GPT-2 recipe (demo-cpu)", *VARIANTS]
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(names))
    rows = []
    for seed in range(1337, 1337 + args.seeds):
        for i in chosen:
            preset, sets = ("demo-cpu", []) if i == 0 else ("modern-cpu", VARIANTS[names[i]])
            rows.append(run_variant(names[i], preset, sets, args, seed))
            print(json.dumps(rows[-1]), flush=True)
    full = {r["seed"]: r["bpb"] for r in rows if r["variant"] == "modern (all)"}
    print("\n| variant | val bpb | vs modern (all) | ms/step |\n| --- | --- | --- | --- |")
    for r in rows:
        delta = f"{r['bpb'] - full[r['seed']]:+.3f}" if r["seed"] in full else ""
        print(f"| {r['variant']} (seed {r['seed']}) | {r['bpb']:.3f} | {delta} | {r['ms']:.0f} |")


if __name__ == "__main__":
    main()
