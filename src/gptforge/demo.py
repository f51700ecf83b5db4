"""`gptforge demo`: prepare the stdlib corpus, train a small code model on CPU, report, sample and plot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from gptforge.checkpoint import load_checkpoint
from gptforge.config import load_config
from gptforge.data.prepare import prepare
from gptforge.generate import generate
from gptforge.plot import plot_runs
from gptforge.trainer import train

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(path):", "class Stack:\n    def __init__(self):"]
VAL_FRACTION = 0.02
# A BPE trained on the stdlib packs 3.65 bytes/token against GPT-2's 2.06 on this code, and its small
# output layer leaves the CPU's time to the transformer: the better model per minute (README, Results).
VOCAB_SIZE = 8192


def run_demo(out: str, data: str, time_budget: float | None, overrides: list[str]) -> dict:
    out_dir, data_dir = Path(out), Path(data)
    cfg = load_config("demo-cpu", [*overrides, f"data.path={data_dir}"])
    if time_budget is not None:
        cfg.train.time_budget = time_budget
    prepare("stdlib", data_dir, val_fraction=VAL_FRACTION, train_tokenizer=VOCAB_SIZE)  # reused when unchanged
    if (out_dir / "config.toml").is_file():
        print(f"demo: replacing the previous demo run in {out_dir}")
        shutil.rmtree(out_dir)
    result = train(cfg, out_dir)

    before, after = result.first_val, result.last_val
    uniform = math.log(cfg.model.vocab_size)
    print("\n=== validation (held-out stdlib files) ===")
    print(f"{'':>10} {'loss':>8} {'ppl':>10} {'bits/byte':>10}")
    print(f"{'uniform':>10} {uniform:>8.4f} {cfg.model.vocab_size:>10,}")
    for name, v in (("before", before), ("after", after)):
        print(f"{name:>10} {v['loss']:>8.4f} {v['ppl']:>10.2f} {v['bpb']:>10.3f}")

    model, tok, _, _ = load_checkpoint(result.checkpoint)
    g = torch.Generator().manual_seed(0)
    completions = []
    print("\n=== completions (temperature 0.6, top-k 50) ===")
    for prompt in PROMPTS:
        new = generate(model, tok.encode(prompt), 96, temperature=0.6, top_k=50, eot=tok.eot, generator=g)[0]
        completions.append(prompt + tok.decode(new))
        print(f"--- {prompt.splitlines()[0]}\n{completions[-1]}\n")

    plot, _ = plot_runs([out_dir])
    summary = {
        "before": before,
        "after": after,
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "params": model.num_params(),
        "checkpoint": str(result.checkpoint),
        "plot": str(plot),
        "completions": completions,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {result.checkpoint}, {out_dir / 'metrics.jsonl'}, {plot}, {out_dir / 'summary.json'}")
    return summary
