"""Validation loss, perplexity and bits per byte over a fixed sample of the validation split."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
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
    """Mean token loss with ppl and bpb, over windows spread evenly across `split` (the same every call).

    Spreading matters: a prefix of the split covers a few documents, which can be far easier than the rest.
    """
    loader = TokenLoader(data_dir, split, batch_size, seq_len, shuffle=False)
    steps = max(1, min(max_tokens // (batch_size * seq_len), loader.batches_per_epoch))
    windows = np.linspace(0, loader.n_windows - 1, steps * batch_size).round().astype(np.int64)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(steps):
        x, y = loader.batch(windows[i * batch_size : (i + 1) * batch_size])
        with autocast(device, dtype):
            _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    model.train(was_training)
    loss = total.item() / steps
    stats = read_manifest(data_dir)["splits"][split]
    # bpb = nats/token / ln 2 * tokens/byte; unknown (NaN) for shard folders that did not record bytes.
    bits_per_byte = loss / math.log(2) * stats["tokens"] / stats["bytes"] if stats["bytes"] else float("nan")
    return {"loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte, "tokens": steps * batch_size * seq_len}
