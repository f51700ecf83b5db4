"""Sampling with a KV cache: temperature, top-k, top-p, a seeded generator, stop at EOT, crop to the block size."""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
    best = x.argmax(dim=-1)
    _check_finite(x.gather(-1, best[:, None]))  # argmax picks a NaN or +inf if there is one
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
    if not torch.isfinite(values).all():  # inf/nan logits: a diverged model, not something to sample from
        raise GptforgeError("the model's next-token probabilities are not finite (its weights have diverged)")


def forward_logits(model: GPT, idx: torch.Tensor, cache: KVCache | RowCache | None) -> torch.Tensor:
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
    logits = forward_logits(model, idx[:, -block:], cache)
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
            logits = forward_logits(model, nxt[:, None], cache)
        else:
            cache = None
            logits = forward_logits(model, idx[:, -block:], None)


def generate(model: GPT, prompt: list[int], max_new_tokens: int, num_samples: int = 1, **kwargs) -> list[list[int]]:
    """New tokens (EOT and after dropped) for each of `num_samples` continuations of `prompt`."""
    steps = list(stream(model, prompt, max_new_tokens, num_samples, **kwargs))
    if not steps:
        return [[] for _ in range(num_samples)]
    tokens = torch.stack(steps, dim=1).tolist()
    eot = kwargs.get("eot")
    return [row[: row.index(eot)] if eot in row else row for row in tokens]


@dataclass(eq=False)
class Generation:
    """One prompt for `generate_batch`: how its next tokens are picked, how many it may write, what it has written."""

    prompt: list[int]
    max_new_tokens: int
    rule: Sampling = Sampling(temperature=0.0)
    generator: torch.Generator | None = None
    new: list[int] = field(default_factory=list)


@torch.no_grad()
def generate_batch(
    model: GPT,
    items: list[Generation],
    ends: set[int],
    done: Callable[[Generation], bool] = lambda item: False,
    rows: int = 16,
) -> list[Generation]:
    """Continue every item, up to `rows` at a time in one forward pass (continuous batching: an item that ends
    frees its row for the next): each writes the tokens it would alone through `stream`, greedy or drawing from its
    own generator. An item ends at a token in `ends` (not kept), at `done(item)` or at its max_new_tokens; each
    must fit the context (prompt + max_new_tokens - 1 tokens), as nothing slides here."""
    device, block = next(model.parameters()).device, model.config.block_size
    for item in (i for i in items if i.max_new_tokens > 0):
        if not item.prompt or len(item.prompt) + item.max_new_tokens - 1 > block:
            raise ValueError(f"a prompt of {len(item.prompt)} tokens and {item.max_new_tokens} new ones: past {block}")
    waiting, active = deque(i for i in items if i.max_new_tokens > 0), []
    cache = RowCache(model.config, rows, device)
    while waiting or active:
        while waiting and len(active) < rows:
            item, prompt = waiting.popleft(), KVCache(model.config, 1, device)
            logits = forward_logits(model, torch.tensor([item.prompt], device=device), prompt)[:, -1]
            if _extend([item], logits, ends, done):  # it goes on: a row
                cache.add(prompt)
                active.append(item)
        if active:
            idx = torch.tensor([[item.new[-1]] for item in active], device=device)
            going = _extend(active, forward_logits(model, idx, cache)[:, -1], ends, done)
            for row in reversed(range(len(active))):  # the last row moves into a freed one: from the end
                if active[row] not in going:
                    cache.remove(row)
                    last = active.pop()
                    if row < len(active):
                        active[row] = last
    return items


def _extend(items: list[Generation], logits: torch.Tensor, ends: set[int], done: Callable) -> list[Generation]:
    """Each item's next token from its row of logits; the items that go on."""
    uniforms = None
    if not all(item.rule.greedy for item in items):  # a greedy row draws nothing, as it would alone
        unused = torch.zeros(1, dtype=torch.float64, device=logits.device)
        draw = functools.partial(torch.rand, 1, dtype=torch.float64, device=logits.device)
        uniforms = torch.cat([unused if i.rule.greedy else draw(generator=i.generator) for i in items])
    going = []
    for item, token in zip(items, sample_rows(logits, [i.rule for i in items], uniforms).tolist(), strict=True):
        if token in ends:
            continue
        item.new.append(token)
        if len(item.new) < item.max_new_tokens and not done(item):
            going.append(item)
    return going
