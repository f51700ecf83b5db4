"""`gptforge sample`: continuations of prompts from a checkpoint, as printable text while the tokens arrive."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gptforge.checkpoint import Inference, load_for_inference
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
    dtype: str = "auto",
) -> Iterator[str]:
    """Load the checkpoint (a bad one fails here), then yield text to print as it is generated: a
    `--- sample N` line, the prompt, its continuation and a newline, for each sample of each prompt."""
    run = load_for_inference(checkpoint, device, dtype)
    g = torch.Generator(device=run.device).manual_seed(seed)
    settings = (max_new_tokens, 1, temperature, top_k, top_p, run.tokenizer.eot, g, use_cache)
    return _pieces(run, prompts, num_samples, settings)


def _pieces(run: Inference, prompts: list[str], num_samples: int, settings: tuple) -> Iterator[str]:
    tok, index = run.tokenizer, 0
    for prompt in prompts:
        # An empty prompt starts a fresh document, as training documents start after EOT.
        ids = tok.encode(prompt) or [tok.eot]
        for _ in range(num_samples):
            yield f"--- sample {index}\n{prompt}"
            new: list[int] = []
            shown = ""
            tokens = stream(run.model, ids, *settings)
            while True:
                with autocast(run.device, run.dtype):  # around the model only, not around our caller's code
                    nxt = next(tokens, None)
                if nxt is None or int(nxt) == tok.eot:
                    break
                new.append(int(nxt))
                text = tok.decode(new)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    yield text[len(shown) :]
                    shown = text
            yield tok.decode(new)[len(shown) :] + "\n"
            index += 1
