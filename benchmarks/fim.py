"""Is fill-in-the-middle free? Train the demo's model with `data.fim_rate` 0 and 0.5 at equal time (seeds as given),
then score each checkpoint: left-to-right validation bits per byte over the whole held-out split, single-line
infilling exact match against the prefix alone, and the parse rate of sampled function bodies.

    python benchmarks/fim.py --data data/stdlib [--budget 540] [--seeds 1,2] [--rates 0,0.5] [--code 200]
                             [--out runs/fim-bench] [--json OUT.json]

Each run is its own `gptforge train` process, as `make demo` runs it; nothing else should run on the machine."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def gptforge(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gptforge", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"gptforge {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--budget", type=int, default=540)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--rates", default="0,0.5")
    parser.add_argument("--code", type=int, default=200)
    parser.add_argument("--config", default="modern-cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/fim-bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for seed in args.seeds.split(","):
        for rate in args.rates.split(","):
            run = args.out / f"fim{rate}-seed{seed}"
            sets = [f"train.time_budget={args.budget}", f"train.seed={seed}", f"data.fim_rate={rate}"]
            if not (run / "summary.json").is_file() and not any((run / "checkpoints").glob("step_*")):
                gptforge("train", "--config", args.config, "--data", args.data, "--out", str(run),
                         *[a for s in sets for a in ("--set", s)])  # fmt: skip
            scores = json.loads(gptforge("eval", str(run), "--data", args.data, "--code", str(args.code), "--json"))
            row = {"seed": int(seed), "fim_rate": float(rate), "step": scores["step"], "val_bpb": scores["val"]["bpb"]}
            row |= {k: scores["code"][k] for k in ("infill_exact", "prefix_exact", "parse_rate", "cases", "functions")}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
