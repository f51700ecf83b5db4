"""Sampling: temperature, top-k, a seeded generator, stop at EOT, context cropped to the block size."""

from __future__ import annotations

import torch

from gptforge.model import GPT


@torch.no_grad()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_k: int | None = 50,
    eot: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New tokens for each of `num_samples` continuations of `prompt` (greedy when temperature is 0)."""
    device = next(model.parameters()).device
    idx = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(num_samples)]
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.config.block_size :])
        logits = logits[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
        for i, t in enumerate(nxt[:, 0].tolist()):
            if not done[i]:
                if t == eot:
                    done[i] = True
                else:
                    out[i].append(t)
        if bool(done.all()):
            break
    return out
