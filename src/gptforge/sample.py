"""`gptforge sample`: stream continuations of prompts from a checkpoint to the terminal."""

from __future__ import annotations

import sys

import torch

from gptforge.checkpoint import load_checkpoint
from gptforge.generate import stream
from gptforge.runtime import autocast, resolve_device, resolve_dtype


def sample_to_terminal(
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
) -> list[str]:
    """Print each sample as its tokens arrive; returns the full texts (prompt + continuation)."""
    dev = resolve_device(device)
    model, tok, cfg, _ = load_checkpoint(checkpoint, dev)
    dtype = resolve_dtype(cfg.train.dtype, dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    texts = []
    for prompt in prompts:
        # An empty prompt starts a fresh document, as training documents start after EOT.
        ids = tok.encode(prompt) or [tok.eot]
        for _ in range(num_samples):
            print(f"--- sample {len(texts)}", flush=True)
            sys.stdout.write(prompt)
            new: list[int] = []
            shown = ""
            with autocast(dev, dtype):
                for nxt in stream(model, ids, max_new_tokens, 1, temperature, top_k, top_p, tok.eot, g, use_cache):
                    if int(nxt) == tok.eot:
                        break
                    new.append(int(nxt))
                    text = tok.decode(new)
                    if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                        sys.stdout.write(text[len(shown) :])
                        sys.stdout.flush()
                        shown = text
            sys.stdout.write(tok.decode(new)[len(shown) :] + "\n")
            texts.append(prompt + tok.decode(new))
    return texts
