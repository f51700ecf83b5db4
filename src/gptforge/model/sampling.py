"""Picking the next token from logits: greedy, or drawn after temperature, top-k and top-p, each row by its own
rule and uniform so that a row's token does not depend on the rows beside it."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT
from gptforge.model.kv_cache import KVCache, RowCache

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CDF_BLOCK = 256  # columns a draw sums at once: its cumulative sum runs over block totals, then inside one block


@dataclass(frozen=True)
class Sampling:
    """How a row picks its next token: greedy at temperature 0 (or top_k 1), else drawn after top-k and top-p."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of (B, V) logits, every row by the same rule; greedy draws no random number."""
    rule = Sampling(temperature, top_k, top_p)
    if rule.greedy:
        return sample_rows(logits, [rule] * len(logits), None)
    uniforms = torch.rand(len(logits), generator=generator, dtype=torch.float64, device=logits.device)
    return sample_rows(logits, [rule] * len(logits), uniforms)


def sample_rows(logits: torch.Tensor, rules: list[Sampling], uniforms: torch.Tensor | None) -> torch.Tensor:
    """One token id per row of (B, V) logits, row i by rules[i]; a drawn row inverts its cumulative distribution at
    uniforms[i] (in [0, 1)), so it gets the same token alone or beside any other rows. Non-finite logits (a
    diverged model) are an error on every path, greedy included."""
    greedy = [i for i, rule in enumerate(rules) if rule.greedy]
    drawn = [i for i, rule in enumerate(rules) if not rule.greedy]
    if not drawn:
        return _most_likely(logits)
    if not greedy:
        return _draw(logits.float(), rules, uniforms)
    chosen = torch.empty(len(rules), dtype=torch.long, device=logits.device)
    chosen[greedy] = _most_likely(logits[greedy])
    chosen[drawn] = _draw(logits[drawn].float(), [rules[i] for i in drawn], uniforms[drawn])
    return chosen


def _most_likely(x: torch.Tensor) -> torch.Tensor:
    most, best = x.max(dim=-1)  # the first of tied maxima, as argmax; a NaN or +inf if there is one
    _check_finite(most)
    return best


def _draw(x: torch.Tensor, rules: list[Sampling], uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token at its uniform, in float32 (float64 took twice as long): every sum goes row by row,
    so a row's token does not depend on the rows beside it."""
    column = functools.partial(torch.tensor, device=x.device, dtype=x.dtype)
    vocab = x.size(-1)
    # Top-k before the temperature: a huge one rounds the scaled logits into ties, and a tie with the k-th kept all.
    if any(rule.top_k is not None and rule.top_k < vocab for rule in rules):
        top_k = column([min(rule.top_k or vocab, vocab) for rule in rules], dtype=torch.long)
        kth = torch.topk(x, int(top_k.max())).values.gather(-1, top_k[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    # Relative to the row's maximum, a temperature below float32's smallest normal (tiny) sends every logit not
    # tied with the maximum to -inf rather than the maximum to inf (0 / 0 is NaN): 1e-40 is greedy in effect.
    # One past float32's largest would be inf, and -inf / inf is NaN.
    finfo = torch.finfo(x.dtype)
    temperatures = [min(max(rule.temperature, finfo.tiny), finfo.max) for rule in rules]
    if any(t != 1.0 for t in temperatures):  # at 1 this would change no bit: softmax subtracts the maximum itself
        x = (x - x.amax(dim=-1, keepdim=True)) / column(temperatures)[:, None]
    if any(rule.top_p is not None and rule.top_p < 1.0 for rule in rules):
        top_p = column([1.0 if rule.top_p is None else rule.top_p for rule in rules])[:, None]
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        outside = (probs.cumsum(dim=-1) - probs > top_p) & (top_p < 1.0)
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(outside, float("-inf")))
    return _invert(torch.softmax(x, dim=-1), uniforms)


def _invert(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's first token whose cumulative probability reaches 1 - u of the row's total. A cumsum over the
    whole vocabulary is a serial pass per row (half of a draw's time at 50,257 columns): block totals come first,
    then a cumsum over the block totals and over the one block holding the target."""
    rows, vocab = probs.shape
    full = vocab - vocab % CDF_BLOCK
    mass = probs[:, :full].view(rows, -1, CDF_BLOCK).sum(dim=-1)
    if full < vocab:
        mass = torch.cat((mass, probs[:, full:].sum(dim=-1, keepdim=True)), dim=-1)
    ends = mass.cumsum(dim=-1)
    _check_finite(ends[:, -1])  # a NaN or +inf logit makes its row's total NaN
    # Float32 bounds: a token's share of [0, total) is its probability to within a float32 step of the total.
    # 1 - u is in (0, 1], so the target is above zero and at most the total: some block reaches it.
    target = (1.0 - uniforms).to(ends)[:, None] * ends[:, -1:]
    block = torch.searchsorted(ends, target)
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    cdf = probs.gather(-1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0).cumsum(dim=-1)
    # Blocks before this one end below the target, so the rest is above zero and the first column reaching it
    # has mass. Rounding can leave the rest past the block's own cumsum: then the first column reaching its end.
    rest = torch.minimum(target - F.pad(ends, (1, 0)).gather(-1, block), cdf[:, -1:])
    return columns.gather(-1, torch.searchsorted(cdf, rest)).squeeze(-1)


def _check_finite(values: torch.Tensor) -> None:
    # In Python: isfinite().all() and its bool took 20 us on CPU, 7% of the demo model's compiled step.
    if not all(map(math.isfinite, values.tolist())):  # inf/nan logits: a diverged model, not something to sample from
        raise GptforgeError("the model's next-token probabilities are not finite (its weights have diverged)")


def forward_logits(model: GPT, idx: torch.Tensor, cache: KVCache | RowCache | None) -> torch.Tensor:
    """Logits; on CUDA with SDPA's cuDNN attention left out: it builds a plan for every new sequence length, and
    generation brings one per token (bf16 sampling ran at 12 tokens/s on an H100 with it, 129 without)."""
    with sdpa_kernel(NOT_CUDNN) if idx.is_cuda else contextlib.nullcontext():
        return model(idx, cache=cache)[0]
