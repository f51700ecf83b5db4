"""Validation loss, perplexity and bits per byte over a fixed, ordered slice of the validation split."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from gptforge.data.loader import TokenLoader
from gptforge.data.shards import read_manifest
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
) -> dict[str, float]:
    """Mean token loss over the first windows of `split` (the same ones every call), with ppl and bpb."""
    loader = TokenLoader(data_dir, split, batch_size, seq_len, shuffle=False)
    steps = max(1, min(max_tokens // (batch_size * seq_len), loader.batches_per_epoch))
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast(device, dtype):
            _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    model.train(was_training)
    loss = total.item() / steps
    stats = read_manifest(data_dir)["splits"][split]
    bits_per_byte = loss / math.log(2) * stats["tokens"] / max(1, stats["bytes"])
    return {"loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte, "tokens": steps * batch_size * seq_len}
