"""Validation loss, perplexity and bits per byte over a fixed sample of the validation split."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from gptforge.data.loader import TokenLoader
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT
from gptforge.runtime.device import autocast
from gptforge.runtime.distributed import SINGLE, DistEnv, all_reduce_sum


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def evaluated_windows(loader: TokenLoader, max_tokens: int) -> np.ndarray:
    """The windows an evaluation of `max_tokens` tokens scores: as many as fit (at least one, at most the split's),
    spread evenly across the split, since a prefix covers a few documents, which can be far easier than the rest."""
    count = max(1, min(max_tokens // loader.T, loader.n_windows))
    return np.linspace(0, loader.n_windows - 1, count).round().astype(np.int64)


def evaluated_tokens(loader: TokenLoader, max_tokens: int) -> int:
    """The tokens an evaluation of `max_tokens` scores on `loader`'s split (the announcement says this)."""
    return len(evaluated_windows(loader, max_tokens)) * loader.T


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
    """Mean token loss with ppl and bpb over `evaluated_windows` of `split` (the same every call).

    Ranks score disjoint shares of the same windows, `batch_size` at a time: neither the world size nor the batch
    size changes which tokens are scored. A caller that evaluates repeatedly passes its unshuffled `loader` of the
    split, built once.
    """
    loader = loader or TokenLoader(data_dir, split, batch_size, seq_len, shuffle=False)
    if loader.masks is not None and getattr(model, "config", None) and model.config.document_token < 0:
        raise GptforgeError(
            f"{data_dir}: conversations (prepare --chat), which only a model fine-tuned on them reads; this one is a "
            "base model (fine-tune it: train with --set train.init_from=...)"
        )
    mine = evaluated_windows(loader, max_tokens)[env.rank :: env.world_size]
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of token losses, tokens)
    for i in range(0, len(mine), batch_size):
        x, y = loader.batch(mine[i : i + batch_size])
        with autocast(device, dtype):
            _, loss = model(x.to(device), y.to(device))
        counted = int((y >= 0).sum())  # a chat folder's targets outside the replies are -1: not scored
        sums[0] += loss.double() * counted
        sums[1] += counted
    loader.verify()  # a short evaluation can end before the background check: its result must still be refused
    model.train(was_training)
    all_reduce_sum(sums, env)
    loss = (sums[0] / sums[1]).item()
    # bpb = nats/token / ln 2 * tokens/byte; unknown (NaN) for shard folders that did not record bytes.
    bits_per_byte = loss / math.log(2) / bytes_per_token(loader.manifest, split)
    return {"loss": loss, "ppl": perplexity(loss), "bpb": bits_per_byte, "tokens": int(sums[1].item())}


def bytes_per_token(manifest: dict, split: str) -> float:
    """UTF-8 bytes per scored token of a split (a chat folder's: of the replies); unknown (NaN) for shard folders
    that did not record bytes."""
    stats = manifest["splits"][split]
    tokens, n_bytes = stats.get("assistant_tokens", stats["tokens"]), stats.get("assistant_bytes", stats["bytes"])
    return n_bytes / tokens if n_bytes and tokens else float("nan")


def mixture_loss(
    scores: dict[str, dict[str, float]], shares: dict[str, float], bytes_per_token: dict[str, float]
) -> dict[str, float]:
    """A mixture's validation numbers from its sources' `scores`: the loss is their mean weighted by the mixture's
    `shares` (the expected loss of a token drawn from the mix), bpb the bits of that token over its expected bytes
    (sum of share x bits per token / sum of share x bytes per token); each source's as `loss/NAME`, `bpb/NAME`.
    Sources without a score (no val split) leave the means, the other shares renormalised."""
    total = sum(shares[name] for name in scores)
    loss = sum(shares[name] * score["loss"] for name, score in scores.items()) / total
    bytes_ = sum(shares[name] * bytes_per_token[name] for name in scores) / total
    per_source = {f"{key}/{name}": score[key] for name, score in scores.items() for key in ("loss", "bpb")}
    tokens = sum(int(score["tokens"]) for score in scores.values())
    return {"loss": loss, "ppl": perplexity(loss), "bpb": loss / math.log(2) / bytes_, "tokens": tokens, **per_source}


def format_loss(result: dict[str, float]) -> str:
    r = result
    text = f"loss {r['loss']:.4f} | ppl {r['ppl']:.2f} | bpb {r['bpb']:.3f} over {r['tokens']:,} tokens"
    sources = [key[5:] for key in r if key.startswith("loss/")]
    return text + "".join(f" | {name} {r[f'loss/{name}']:.4f} ({r[f'bpb/{name}']:.3f} bpb)" for name in sources)
