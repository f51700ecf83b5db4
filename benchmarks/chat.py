"""Does fine-tuning make the demo's model answer requests? Fine-tune the demo's base model (`--base`) on the
stdlib's documented-function conversations (`gptforge demo --chat`'s data), fully and with LoRA, for a fixed number
of steps per seed, then score each on the held-out conversations (from the validation split's files):

- the replies' validation loss (the assistant's tokens only) against the base model given the same formatted
  conversations (the fine-tuning run's step-0 evaluation: the base, with fresh rows for the template's tokens);
- the share of greedy replies to held-out requests that parse as Python and define the function asked for;
- for LoRA against full: trainable parameters, peak memory (RSS) and time a step.

    python benchmarks/chat.py --base runs/demo --data data/stdlib [--steps 150] [--seeds 1337,1338]
                              [--requests 64] [--rank 8] [--lora-lrs 1e-2] [--out runs/chat-bench]
                              [--json OUT.json]

Each run is its own `gptforge train` process; nothing else should run on the machine for the timings."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from gptforge.checkpoint import latest_checkpoint, load_checkpoint
from gptforge.data.chat.instructions import defines_function
from gptforge.demo import prepare_function_conversations
from gptforge.model.generate import Generation, generate_batch
from gptforge.model.gpt import GPT
from gptforge.tokens.chat import Message, format_chat, with_chat
from gptforge.train.finetune import fit_vocabulary


def finetune(base: Path, chat_data: Path, out: Path, seed: str, steps: int, extra: list[str]) -> dict:
    """One `gptforge train` fine-tuning run; its header's trainable count, peak RSS and mean step time."""
    settings = [f"train.init_from={latest_checkpoint(base)}", f"train.max_steps={steps}", f"train.seed={seed}"]
    settings += ["train.time_budget=0", f"eval.every={steps}", *extra]
    args = [
        sys.executable,
        "-m",
        "gptforge",
        "train",
        "--config",
        "chat-cpu",
        "--data",
        str(chat_data),
        "--out",
        str(out),
    ]
    started, log = time.time(), out.with_name(f"{out.name}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        child = subprocess.Popen(
            [*args, *(x for s in settings for x in ("--set", s))], stdout=f, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory, not the largest so far
    printed = log.read_text()
    if status:
        raise SystemExit(f"training {out} failed:\n{printed[-2000:]}")
    peak_mb = usage.ru_maxrss / 1024
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ms = sorted(r["ms"] for r in records if r["kind"] == "train")[1:]  # the first step pays warm-up
    vals = [r for r in records if r["kind"] == "val"]
    lora = re.search(r"LoRA: .*?; ([\d,]+) trainable parameters", printed)
    header = re.search(r"model: ([\d,]+) parameters", printed)
    trainable = int((lora or header).group(1).replace(",", ""))
    return {
        "run": str(out),
        "seed": seed,
        "val_before": vals[0]["loss"],
        "val_after": vals[-1]["loss"],
        "trainable": trainable,
        "peak_rss_mb": round(peak_mb),
        "ms_per_step": round(sorted(ms)[len(ms) // 2], 1),
        "seconds": round(time.time() - started, 1),
    }


def base_with_template(base: Path) -> tuple[GPT, object]:
    """The base model given the chat template's tokens as the fine-tuning starts it: fresh rows, same weights."""
    model, tok, cfg, _ = load_checkpoint(base)
    tok = with_chat(tok)
    grown_cfg = type(cfg.model)(**{**vars(cfg.model), "vocab_size": tok.vocab_size})
    grown = GPT(grown_cfg)
    grown.load_state_dict(fit_vocabulary(model.state_dict(), grown_cfg))
    return grown.eval(), tok


def reply_share(model: GPT, tok, requests: list[dict], max_new: int = 160) -> float:
    """Share of greedy replies that parse as Python and define the function each request asks for."""
    block = model.config.block_size
    items = []
    for row in requests:
        prompt = format_chat(tok, [Message("user", row["messages"][0]["content"])], add_generation_prompt=True)
        ids = prompt.ids.tolist()[-(block // 2) :]
        items.append(Generation(ids, min(max_new, block - len(ids) + 1)))
    with torch.no_grad():
        done = generate_batch(model, items, {tok.im_end, tok.eot})
    names = [row["source"].rsplit(":", 1)[1] for row in requests]
    return sum(defines_function(tok.decode(item.new), name) for item, name in zip(done, names, strict=True)) / len(
        names
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=Path("runs/demo"))
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="1337,1338")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lora-lrs", default="1e-2", help="LoRA's AdamW learning rates, one run each per seed")
    parser.add_argument("--out", type=Path, default=Path("runs/chat-bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    chat_data = args.data.with_name(f"{args.data.name}-chat")
    rows_file = prepare_function_conversations(args.data, chat_data)
    held_out = [r for r in map(json.loads, rows_file.read_text().splitlines()) if r["split"] == "val"]
    requests = held_out[:: max(1, len(held_out) // args.requests)][: args.requests]
    base_model, tok = base_with_template(args.base)
    results = {"requests": len(requests), "base_share": reply_share(base_model, tok, requests), "runs": []}
    print(f"base: {results['base_share']:.1%} of {len(requests)} replies define the function asked for", flush=True)
    loras = {
        f"lora{args.rank}-lr{lr}": [f"train.lora_rank={args.rank}", f"optim.lr={lr}"] for lr in args.lora_lrs.split(",")
    }
    for seed in args.seeds.split(","):
        for kind, extra in {"full": [], **loras}.items():
            run = finetune(args.base, chat_data, args.out / f"{kind}-seed{seed}", seed, args.steps, extra)
            model, tuned_tok, _, _ = load_checkpoint(run["run"])
            run.update(kind=kind, share=reply_share(model, tuned_tok, requests))
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
