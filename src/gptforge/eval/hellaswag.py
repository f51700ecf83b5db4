"""HellaSwag, completion style as in the GPT-2 reproductions: score each ending by its tokens' loss after the context.

`acc` picks the ending with the lowest summed loss, `acc_norm_token` the lowest mean loss per ending token (the
GPT-2 reproductions' acc_norm: GPT-2 124M 29.55%), `acc_norm_char` the lowest loss per character of the ending
(lm-evaluation-harness's acc_norm: GPT-2 124M 31.14% there). Examples are sharded over ranks, counts all-reduced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gptforge.data.sources import open_hf_dataset
from gptforge.errors import GptforgeError
from gptforge.inputs import not_utf8, read_jsonl, require_regular_file
from gptforge.model.gpt import GPT
from gptforge.runtime.device import autocast
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_sum
from gptforge.tokens.tokenizer import Tokenizer

GPT2_124M_ACC_NORM = 0.2955  # OpenAI GPT-2 124M, acc_norm_token (build-nanogpt, llm.c)
GPT3_125M_ACC_NORM = 0.337  # GPT-3 Small, zero-shot (GPT-3 paper, table 3.4)


def read_examples(source: str, limit: int = 0, flag: str = "--hellaswag") -> list[dict[str, Any]]:
    """Examples with `ctx`, `endings` (4) and `label`, from the official jsonl[.gz] or `hf:Rowan/hellaswag`;
    `flag` is the option that named `source`, for messages."""
    if source.startswith("hf:"):
        rows = open_hf_dataset(source[3:], "validation", f"{flag} {source}")
        examples = ({"ctx": r["ctx"], "endings": r["endings"], "label": int(r["label"])} for r in rows)
    else:
        path = require_regular_file(source, flag)  # a FIFO or device would block the read forever
        examples = (_parse(record, where) for where, record in read_jsonl(path))
    out = []
    for example in examples:
        out.append(example)
        if limit and len(out) >= limit:
            break
    if not out:
        raise GptforgeError(f"{source}: no HellaSwag examples (expected JSON lines with ctx, endings and label)")
    return out


def _parse(r: Any, where: str) -> dict[str, Any]:
    """A record with a text `ctx`, a list of 4 text `endings` and an integer `label` in 0..3 (the official file
    writes the label as an integer or its digits), each checked: a bad row is one line naming it."""
    expected = f"{where}: expected a HellaSwag record: ctx text, endings a list of 4 texts, label 0..3"
    if not isinstance(r, dict) or not {"ctx", "endings", "label"} <= r.keys():
        raise GptforgeError(f"{expected} (it has {_kind(r)})")
    ctx, endings, label = r["ctx"], r["endings"], r["label"]
    if isinstance(label, str) and label in ("0", "1", "2", "3"):
        label = int(label)
    texts = [ctx, *endings] if isinstance(endings, list) else []
    if not texts or len(endings) != 4 or not all(isinstance(t, str) and not_utf8(t) is None for t in texts):
        raise GptforgeError(f"{expected} (ctx or endings: {_kind(ctx)}, {_kind(endings)})")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < 4:
        raise GptforgeError(f"{expected} (label: {label!r})")
    if not all(t.strip() for t in texts):  # four empty endings tie, and a tie scored the first: 100% for nothing
        raise GptforgeError(f"{expected} (an empty ctx or ending)")
    return {"ctx": ctx, "endings": endings, "label": label}


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return f"an object with {sorted(value)[:5]}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


def render(example: dict[str, Any], tok: Tokenizer, block_size: int) -> tuple[list[list[int]], list[int]]:
    """Token rows context+ending (cropped on the left to the block size) and where each ending starts."""
    ctx = tok.encode(example["ctx"])
    rows, starts = [], []
    for ending in example["endings"]:
        end = tok.encode(" " + ending)  # GPT-2's BPE folds the leading space into the first word
        row = (ctx + end)[-block_size:]
        rows.append(row)
        starts.append(len(row) - len(end))
    return rows, starts


@torch.no_grad()
def evaluate_hellaswag(
    model: GPT,
    tok: Tokenizer,
    examples: list[dict[str, Any]],
    device: torch.device,
    dtype: torch.dtype,
    env: DistEnv = SINGLE,
    batch_examples: int = 8,
) -> dict[str, float]:
    """acc, acc_norm_token and acc_norm_char over `examples`; each rank scores examples rank, rank + world, ..."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(4, dtype=torch.long, device=device)  # correct by sum, per token, per character; examples
    mine = examples[env.rank :: env.world_size]
    for i in range(0, len(mine), batch_examples):
        rendered = [render(e, tok, model.config.block_size) for e in mine[i : i + batch_examples]]
        rows = [(row, start) for rs, starts in rendered for row, start in zip(rs, starts, strict=True)]
        width = max(len(row) for row, _ in rows)
        idx = torch.zeros(len(rows), width, dtype=torch.long)  # 4 rows per example, right-padded
        mask = torch.zeros(len(rows), width, dtype=torch.bool)  # True on the ending's tokens
        for r, (row, start) in enumerate(rows):
            idx[r, : len(row)] = torch.tensor(row)
            mask[r, start : len(row)] = True
        idx, mask = idx.to(device), mask.to(device)
        with autocast(device, dtype):
            logits, _ = model(idx, all_logits=True)
        # Position t predicts token t+1: score the ending tokens.
        losses = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), idx[:, 1:], reduction="none")
        scored = mask[:, 1:]
        total = (losses * scored).sum(1).view(-1, 4)
        per_token = total / scored.sum(1).view(-1, 4)
        chars = [max(len(ending), 1) for e in mine[i : i + batch_examples] for ending in e["endings"]]
        per_char = total / torch.tensor(chars, device=device).view(-1, 4)
        labels = torch.tensor([e["label"] for e in mine[i : i + batch_examples]], device=device)
        for j, loss in enumerate((total, per_token, per_char)):
            counts[j] += (loss.argmin(1) == labels).sum()
        counts[3] += len(labels)
    model.train(was_training)
    all_reduce_sum(counts, env)
    n, c = int(counts[3]), [x / max(int(counts[3]), 1) for x in counts.tolist()]
    return {"acc": c[0], "acc_norm_token": c[1], "acc_norm_char": c[2], "n": n}


def format_hellaswag(result: dict[str, float]) -> str:
    return (
        f"acc {result['acc']:.4f} | acc_norm_token {result['acc_norm_token']:.4f} | "
        f"acc_norm_char {result['acc_norm_char']:.4f} over {result['n']} examples"
    )
