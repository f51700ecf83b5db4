"""GRPO's arithmetic: a group's advantages from its rewards, the replies as one padded batch, their tokens' log
probabilities, and the token-level policy-gradient loss (PPO's clip for more than one update a batch, a KL term
to the starting policy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptforge.model.gpt import GPT

SPREAD_EPS = 1e-4  # a group whose rewards all agree has no spread: its advantages stay 0, not 0/0


def group_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """(groups, n) rewards -> each reward minus its group's mean, divided by the group's (population) standard
    deviation when `scale` (GRPO's form; unscaled, a group's advantages keep the rewards' units: Dr. GRPO)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + SPREAD_EPS)
    return centred


@dataclass
class ReplyBatch:
    """Replies as rows: `idx` the prompt then the reply but its last token, right-padded; `targets` the next ids;
    `mask` 1 where a target is a reply token (the loss counts those alone)."""

    idx: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def reply_batch(prompts: list[list[int]], replies: list[list[int]], device: torch.device) -> ReplyBatch:
    rows = [p + r for p, r in zip(prompts, replies, strict=True)]
    width = max(len(row) for row in rows) - 1
    idx = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        idx[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, : len(row) - 1] = torch.tensor(row[1:])
        mask[i, len(prompt) - 1 : len(row) - 1] = 1.0  # the targets that are the reply's tokens
    return ReplyBatch(idx.to(device), targets.to(device), mask.to(device))


def token_logprobs(model: GPT, batch: ReplyBatch) -> torch.Tensor:
    """(B, T) log probability of each target under `model` (fp32; padding's are meaningless, masked later)."""
    logits = model(batch.idx, all_logits=True)[0].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, batch.targets[..., None])[..., 0]


@dataclass
class LossParts:
    """The loss to step on, and what it logs: the mean KL to the start (k3) and the share of tokens clipped."""

    loss: torch.Tensor
    kl: float
    clipped: float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tokens: int,
    clip: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """Sum over reply tokens of -min(ratio A, clip(ratio) A) (+ kl_coef * k3 KL to `ref_logp`), over `tokens`,
    the reply tokens of the whole step (every rank's): each token weighs the same whatever its reply's length. The
    KL is measured whenever `ref_logp` is given, in the loss only with a kl_coef."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3: an unbiased, never negative estimate of KL(pi || ref)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    clipped = ((ratio - 1).abs() > clip).float()
    loss = (per_token * mask).sum() / tokens
    count = mask.sum().clamp(min=1)
    return LossParts(loss, float((kl.detach() * mask).sum() / count), float((clipped * mask).sum() / count))
