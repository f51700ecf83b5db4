"""Sampling with a KV cache: temperature, top-k, top-p, a seeded generator, stop at EOT, crop to the block size."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT, KVCache

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of (B, V) logits; greedy when temperature is 0. Non-finite logits (a diverged model)
    are an error on every path, greedy included."""
    if temperature <= 0 or top_k == 1:  # greedy, however asked: the same token, and no random number drawn
        chosen = logits.argmax(dim=-1)
        _check_finite(logits.gather(-1, chosen[:, None]))  # argmax picks a NaN or +inf if there is one
        return chosen
    # In float64 and relative to the row's maximum, a tiny temperature sends every other logit to -inf rather
    # than the maximum to inf (inf - inf is NaN): 1e-40 is greedy in effect, as it should be.
    logits = logits.double()
    _check_finite(logits.amax(dim=-1))
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        outside = probs.cumsum(dim=-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    _check_finite(probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_finite(values: torch.Tensor) -> None:
    if not torch.isfinite(values).all():  # inf/nan logits: a diverged model, not something to sample from
        raise GptforgeError("the model's next-token probabilities are not finite (its weights have diverged)")


def _forward(model: GPT, idx: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """Logits; on CUDA with SDPA's cuDNN attention left out: it builds a plan for every new sequence length, and
    generation brings one per token (bf16 sampling ran at 12 tokens/s on an H100 with it, 129 without)."""
    with sdpa_kernel(NOT_CUDNN) if idx.is_cuda else contextlib.nullcontext():
        return model(idx, cache=cache)[0]


@torch.no_grad()
def stream(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_k: int | None = 50,
    top_p: float | None = None,
    eot: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield a (num_samples,) tensor of new ids per step; rows that produced EOT keep yielding EOT.

    The cache serves while the sequence fits the block size; past it every step recomputes the last
    block_size tokens, exactly as the uncached path does, so both give the same tokens.
    """
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    device = next(model.parameters()).device
    block = model.config.block_size
    idx = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    cache = KVCache(model.config, num_samples, device) if use_cache and len(prompt) < block else None
    logits = _forward(model, idx[:, -block:], cache)
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        if eot is not None:
            nxt = torch.where(done, torch.full_like(nxt, eot), nxt)
            done |= nxt == eot
        yield nxt
        if bool(done.all()):
            return
        idx = torch.cat([idx, nxt[:, None]], dim=1)
        if cache is not None and cache.pos < block:
            logits = _forward(model, nxt[:, None], cache)
        else:
            cache = None
            logits = _forward(model, idx[:, -block:], None)


def generate(model: GPT, prompt: list[int], max_new_tokens: int, num_samples: int = 1, **kwargs) -> list[list[int]]:
    """New tokens (EOT and after dropped) for each of `num_samples` continuations of `prompt`."""
    steps = list(stream(model, prompt, max_new_tokens, num_samples, **kwargs))
    if not steps:
        return [[] for _ in range(num_samples)]
    tokens = torch.stack(steps, dim=1).tolist()
    eot = kwargs.get("eot")
    return [row[: row.index(eot)] if eot in row else row for row in tokens]
