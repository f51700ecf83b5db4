"""Muon for 2-D hidden matrices: torch.optim.Muon's algorithm, state and parameter groups, orthogonalising in a
chosen precision and all matrices of one shape in one batched product.

torch's own always orthogonalises in bf16, the slower precision on CPUs whose bf16 matmuls are slow (modern-cpu's
16 matrices: 133 ms a step in bf16, 94 ms in fp32 batched, on a 2-core Xeon), and one matrix at a time.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

# The quintic Newton–Schulz coefficients of Keller Jordan's Muon, as torch.optim.Muon uses them.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalise(
    g: torch.Tensor, dtype: torch.dtype, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7
) -> torch.Tensor:
    """Newton–Schulz approximation of U V^T of an (m, n) matrix or each of a (k, m, n) batch, computed in `dtype`
    (a lone matrix takes torch's own 2-D products, so bf16 results equal torch.optim.Muon's bit for bit)."""
    a, b, c = coefficients
    product = torch.addmm if g.dim() == 2 else torch.baddbmm
    x = g.to(dtype)
    wide = x.size(-2) <= x.size(-1)
    x = x if wide else x.mT  # the Gram matrix of the shorter side is the cheaper one
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = product(x, product(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.mT


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-shape learning rate: "original" (the default) or "match_rms_adamw"."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Muon: adjust_lr_fn={adjust_lr_fn!r} (expected 'original' or 'match_rms_adamw')")


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalised update, lr scaled by sqrt(max(1, rows / cols)), decoupled weight decay."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, dtype: torch.dtype) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, ns_coefficients=NS_COEFFICIENTS,
            eps=1e-7, ns_steps=5, adjust_lr_fn=None,
        )  # fmt: skip
        super().__init__(params, defaults)
        if any(p.dim() != 2 for group in self.param_groups for p in group["params"]):
            raise ValueError("Muon takes 2-D matrices only")
        self.dtype = dtype

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                by_shape[p.shape].append((p, p.grad.lerp(buf, momentum) if group["nesterov"] else buf))
            for shape, pairs in by_shape.items():
                params, updates = zip(*pairs, strict=True)
                batch = updates[0] if len(updates) == 1 else torch.stack(updates)
                ortho = orthogonalise(batch, self.dtype, group["ns_coefficients"], group["ns_steps"], group["eps"])
                lr = adjusted_lr(group["lr"], group["adjust_lr_fn"], shape)
                for p, u in zip(params, [ortho] if len(updates) == 1 else ortho.unbind(0), strict=True):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(u, alpha=-lr)
