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


def orthogonalise(g: torch.Tensor, dtype: torch.dtype, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz approximation of U V^T for each (m, n) matrix of a (k, m, n) batch, computed in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(-2) <= x.size(-1)
    x = x if wide else x.mT  # the Gram matrix of the shorter side is the cheaper one
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.mT


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalised update, lr scaled by sqrt(max(1, rows / cols)), decoupled weight decay."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, dtype: torch.dtype) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, ns_coefficients=NS_COEFFICIENTS,
            eps=1e-7, ns_steps=5, adjust_lr_fn=None,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.dtype = dtype

    @torch.no_grad()
    def step(self, closure=None) -> None:
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
                ortho = orthogonalise(torch.stack(updates), self.dtype, group["ns_steps"], group["eps"])
                lr = group["lr"] * math.sqrt(max(1.0, shape[0] / shape[1]))
                for p, u in zip(params, ortho.unbind(0), strict=True):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(u.to(p.dtype), alpha=-lr)
