"""`gptforge sample`: continuations of prompts from a checkpoint, as text pieces while the tokens arrive."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptforge.checkpoint import load_for_inference
from gptforge.model.generate import stream
from gptforge.runtime.device import autocast


def sample_texts(
    checkpoint: str,
    prompts: list[str],
    num_samples: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    device: str = "auto",
    use_cache: bool = True,
) -> Iterator[tuple[int, str]]:
    """(sample index, text piece): the prompt first, then decoded text as it grows, for each sample in turn."""
    run = load_for_inference(checkpoint, device)
    tok = run.tokenizer
    g = torch.Generator(device=run.device).manual_seed(seed)
    index = 0
    for prompt in prompts:
        # An empty prompt starts a fresh document, as training documents start after EOT.
        ids = tok.encode(prompt) or [tok.eot]
        for _ in range(num_samples):
            yield index, prompt
            new: list[int] = []
            shown = ""
            with autocast(run.device, run.dtype):
                for nxt in stream(run.model, ids, max_new_tokens, 1, temperature, top_k, top_p, tok.eot, g, use_cache):
                    if int(nxt) == tok.eot:
                        break
                    new.append(int(nxt))
                    text = tok.decode(new)
                    if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                        yield index, text[len(shown) :]
                        shown = text
            rest = tok.decode(new)[len(shown) :]
            if rest:
                yield index, rest
            index += 1
