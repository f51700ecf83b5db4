"""Generation for one prompt or a list of them, on the engine: `stream` yields each step's tokens as they come,
`generate` and `generate_batch` return whole continuations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from gptforge.model.engine import GREEDY, Engine, Sequence
from gptforge.model.gpt import GPT
from gptforge.model.sampling import Sampling


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
    decode: str = "rows",
) -> Iterator[torch.Tensor]:
    """Yield a (num_samples,) tensor of new ids per step, the samples drawing in turn from `generator`; rows that
    produced EOT keep yielding EOT. Past the context each step recomputes the last block_size tokens; `decode`
    is the engine's step (DECODES)."""
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    engine = Engine(model, rows=num_samples, use_cache=use_cache, decode=decode)
    rule, ends = Sampling(temperature, top_k, top_p), frozenset(() if eot is None else (eot,))
    seqs = [Sequence(list(prompt), max_new_tokens, rule, generator, ends, prompt_key=0) for _ in range(num_samples)]
    engine.submit(*seqs)
    for step in range(len(prompt), len(prompt) + max_new_tokens):
        engine.step()
        yield torch.tensor([s.ids[step] if len(s.ids) > step else eot for s in seqs])
        if all(s.finish for s in seqs):
            return


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
    rule: Sampling = GREEDY
    generator: torch.Generator | None = None
    new: list[int] = field(default_factory=list)


def generate_batch(
    model: GPT,
    items: list[Generation],
    ends: set[int],
    done: Callable[[Generation], bool] = lambda item: False,
    rows: int = 16,
) -> list[Generation]:
    """Continue every item, up to `rows` at a time (continuous batching): each writes the tokens it would alone,
    greedy or drawing from its own generator. An item ends at a token in `ends` (not kept), at `done(item)` or at
    its max_new_tokens; each must fit the context (prompt + max_new_tokens - 1 tokens), as nothing slides here."""
    block = model.config.block_size
    for item in (i for i in items if i.max_new_tokens > 0):
        if not item.prompt or len(item.prompt) + item.max_new_tokens - 1 > block:
            raise ValueError(f"a prompt of {len(item.prompt)} tokens and {item.max_new_tokens} new ones: past {block}")

    def watcher(item: Generation) -> Callable[[Sequence, int, bool], bool]:
        def watch(seq: Sequence, token: int, stop: bool) -> bool:
            if stop:
                return False
            item.new.append(token)
            return done(item)

        return watch

    seqs = [
        Sequence(list(i.prompt), i.max_new_tokens, i.rule, i.generator, frozenset(ends), watch=watcher(i))
        for i in items
    ]
    Engine(model, rows=rows).run(*seqs)
    return items
