"""`gptforge demo`: prepare the stdlib corpus, train a small code model on CPU, report, sample and plot."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import torch

from gptforge.checkpoint import load_checkpoint
from gptforge.config import load_config
from gptforge.data.fim import FIMTokenizer, end_ids, infill_prompt
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.files import check_output_dir, locked, replacing_dir, write_json
from gptforge.model.generate import generate
from gptforge.report.plot import plot_runs
from gptforge.train.trainer import train

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(path):", "class Stack:\n    def __init__(self):"]
VAL_FRACTION = 0.02
# A BPE trained on the stdlib packs 3.65 bytes/token against GPT-2's 2.06 on this code, and its small
# output layer leaves the CPU's time to the transformer: the better model per minute (benchmarks/RESULTS.md).
VOCAB_SIZE = 8192
# The modern recipe: on this corpus and budget it beats GPT-2's (demo-cpu, `--config demo-cpu`) at equal time on
# every seed `gptforge speedrun` tried (README, Results).
PRESET = "modern-cpu"
# Shown when the demo trains with fill-in-the-middle (`--set data.fim_rate=0.5`; off by default: at the demo's
# 9 minutes it cost 0.014 bits per byte and infilled no held-out line exactly, benchmarks/RESULTS.md).
INFILL = ("def mean(xs):\n    total = 0\n    for x in xs:", "\n    return total / len(xs)\n")


def run_demo(
    out: str,
    data: str,
    time_budget: float | None,
    overrides: list[str],
    force: bool = False,
    preset: str | None = None,
) -> dict:
    """Train into `out` (new or empty; with `force` a non-empty one is replaced once the new run is complete)."""
    out_dir, data_dir = Path(out), Path(data)
    budget = [] if time_budget is None else [f"train.time_budget={time_budget}"]
    cfg = load_config(preset or PRESET, [*overrides, *budget, f"data.path={data_dir}"])
    check_output_dir(out_dir, force, reads=[data_dir])
    stdlib = PrepareSettings.from_flags("stdlib", val_fraction=VAL_FRACTION, train_tokenizer=VOCAB_SIZE)
    prepare(stdlib, data_dir)  # reused when unchanged
    with locked(out_dir, "demo"), replacing_dir(out_dir) as run_dir:
        result = train(cfg, run_dir)
    checkpoint = out_dir / result.checkpoint.relative_to(run_dir)

    before, after, vocab = result.first_val, result.last_val, result.config.model.vocab_size
    print("\n=== validation (held-out stdlib files) ===")
    print(f"{'':>10} {'loss':>8} {'ppl':>10} {'bits/byte':>10}")
    print(f"{'uniform':>10} {math.log(vocab):>8.4f} {vocab:>10,}")
    for name, v in (("before", before), ("after", after)):
        print(f"{name:>10} {v['loss']:>8.4f} {v['ppl']:>10.2f} {v['bpb']:>10.3f}")

    model, tok, _, _ = load_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    completions = []
    print("\n=== completions (temperature 0.6, top-k 50) ===")
    for prompt in PROMPTS:
        new = generate(model, tok.encode(prompt), 96, temperature=0.6, top_k=50, eot=tok.eot, generator=g)[0]
        completions.append(prompt + tok.decode(new))
        print(f"--- {prompt.splitlines()[0]}\n{completions[-1]}\n")
    infill = None
    if isinstance(tok, FIMTokenizer):
        prefix, suffix = INFILL
        ends = end_ids(tok)
        new = generate(model, infill_prompt(tok, prefix, suffix), 32, temperature=0.0, eot=tok.eot)[0]
        middle = tok.decode(new[: next((i for i, t in enumerate(new) if t in ends), len(new))])
        infill = {"prefix": prefix, "middle": middle, "suffix": suffix}
        print(f"=== infilling (greedy): the model writes what goes between ===\n{prefix}[{middle}]{suffix}")

    plot = plot_runs([out_dir]).path
    summary = {
        "before": before,
        "after": after,
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "params": model.num_params(),
        "checkpoint": str(checkpoint),
        "plot": str(plot),
        "completions": completions,
        "infill": infill,
    }
    write_json(out_dir / "summary.json", summary)
    print(f"wrote {checkpoint}, {out_dir / 'metrics.jsonl'}, {plot}, {out_dir / 'summary.json'}")
    print("\n=== what next ===\n" + "\n".join(next_commands(out_dir, data_dir)))
    return summary


def next_commands(out_dir: Path, data_dir: Path) -> list[str]:
    """The commands that go on from a demo's run folder: sample, eval, serve and export it."""
    run, data = shlex.quote(str(out_dir)), shlex.quote(str(data_dir))
    return [
        f"gptforge sample {run} --prompt 'def quicksort(xs):'     # more completions",
        f"gptforge eval {run} --data {data}     # the validation loss again (the same tokens)",
        f"gptforge serve {run}     # an OpenAI-compatible API and a page with the curves (the .[serve] extra)",
        f"gptforge export {run} --out {shlex.quote(str(out_dir / 'hf'))}     # a transformers folder",
    ]
