"""Does RL from unit tests make the demo's chat model answer simple requests correctly? The stages of `gptforge demo
--chat`, run one by one per seed on one base (`--base`, the demo's model): greedy pass@1 on the 70 held-out
built-in tasks for the base (each request as comments), after fine-tuning (`chat-cpu` on the demo's conversations)
and after RL (`rl-cpu`), with where an RL step's time went (sampling, scoring in the sandbox, the update). Fixed
step counts (about the demo's 3 + 5 minutes on the recorded host) in place of its time budgets, so that every seed
trains the same compute whatever the host's pace.

    python benchmarks/rl_demo.py --base runs/demo --data data/stdlib [--seeds 1337,1338] [--sft-steps 480]
                                 [--rl-steps 150] [--rl-set KEY=VALUE ...] [--out runs/rl-bench] [--json OUT.json]

Each stage is its own `gptforge` process; nothing else should run on the machine for the timings."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gptforge.checkpoint import latest_checkpoint
from gptforge.demo import held_out_tasks, prepare_function_conversations
from gptforge.rundir import read_metrics
from gptforge.runtime.threads import sustained_matmul_flops

TIMES = ("sample_s", "score_s", "update_s")


def gptforge(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gptforge", *args], check=True)


def flags(settings: list[str]) -> list[str]:
    return [part for setting in settings for part in ("--set", setting)]


def one_seed(args: argparse.Namespace, chat_data: Path, seed: str) -> dict:
    sft, rl = args.out / f"sft-{seed}", args.out / f"rl-{seed}"
    for folder in (sft, rl):
        shutil.rmtree(folder, ignore_errors=True)
    common = [f"train.seed={seed}", "train.time_budget=0"]
    start = time.perf_counter()
    sft_settings = [*common, f"train.init_from={args.base}", f"train.max_steps={args.sft_steps}"]
    gptforge("train", "--config", "chat-cpu", "--data", str(chat_data), "--out", str(sft), *flags(sft_settings))
    sft_seconds = time.perf_counter() - start
    settings = [
        *common,
        f"train.init_from={sft}",
        f"train.max_steps={args.rl_steps}",
        "rl.eval_tasks=70",
        *(f"rl.{s}" for s in args.rl_set),
    ]
    start = time.perf_counter()
    gptforge("rl", "--out", str(rl), *flags(settings))
    rl_seconds = time.perf_counter() - start
    stages = {"sft": held_out_tasks(latest_checkpoint(sft), "sft"), "rl": held_out_tasks(latest_checkpoint(rl), "rl")}
    records = read_metrics(rl, ("rl", "tasks"))
    steps = records["rl"]
    return {
        "seed": seed,
        "pass@1": {stage: row["pass@1"] for stage, row in stages.items()},
        "parses": {stage: row["parses"] for stage, row in stages.items()},
        "replies": {stage: row["replies"] for stage, row in stages.items()},
        "sft_seconds": round(sft_seconds, 1),
        "rl_seconds": round(rl_seconds, 1),
        "rl_step_seconds": {key: round(statistics.mean(r[key] for r in steps), 3) for key in TIMES},
        "rl_curve": [{k: r[k] for k in ("step", "reward", "pass_rate", "reply_tokens", "kl")} for r in steps],
        "held_out_curve": [{"step": r["step"], "pass@1": r["pass@1"]} for r in records["tasks"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--seeds", default="1337,1338")
    parser.add_argument("--sft-steps", type=int, default=480)
    parser.add_argument("--rl-steps", type=int, default=150)
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE", help="an rl.KEY for RL")
    parser.add_argument("--out", type=Path, default=Path("runs/rl-bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    chat_data = args.data.with_name(f"{args.data.name}-chat")
    prepare_function_conversations(args.data, chat_data)
    base = held_out_tasks(latest_checkpoint(args.base), "base")
    runs = [one_seed(args, chat_data, seed) for seed in args.seeds.split(",")]
    threads = torch.get_num_threads()
    peaks = {
        name: round(sustained_matmul_flops(threads, d) / 1e9, 1)
        for name, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    report = {
        "host": platform.processor() or platform.machine(),
        "cpus": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "matmul_gflops": peaks,
        "sft_steps": args.sft_steps,
        "rl_steps": args.rl_steps,
        "base": {"pass@1": base["pass@1"], "parses": base["parses"], "replies": base["replies"]},
        "runs": runs,
    }
    for run in runs:
        shares = " | ".join(f"{stage} {value:.1%}" for stage, value in run["pass@1"].items())
        print(f"seed {run['seed']}: held-out pass@1 {shares}; an RL step {run['rl_step_seconds']}")
    print(f"host matmul peaks on {threads} threads: {peaks['fp32']} GFLOP/s fp32, {peaks['bf16']} bf16")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
