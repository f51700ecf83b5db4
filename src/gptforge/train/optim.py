"""AdamW with GPT-3 parameter groups (or Muon for the hidden matrices beside it), and learning-rate schedules as
pure functions."""

from __future__ import annotations

import inspect
import math

import torch

from gptforge.config import SCHEDULES, OptimConfig
from gptforge.errors import GptforgeError
from gptforge.train.muon import Muon


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, device_type: str, zero: bool = False, dtype: torch.dtype = torch.float32
) -> torch.optim.Optimizer | MuonAdamW:
    """Weight decay on >=2-D weights (matmuls, embeddings) only; fused AdamW on CUDA; `zero` shards its state
    across the processes of the (initialized) process group. optim.optimizer=muon gives the blocks' matrices to
    Muon, orthogonalising in bf16 for bf16 runs and fp32 otherwise, and the rest (embeddings, lm_head, gains,
    biases) to AdamW."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA: the adapters alone
    hidden = [(n, p) for n, p in named if p.dim() == 2 and ".h." in f".{n}" and ".lora_" not in n]
    muon = [p for _, p in hidden] if cfg.optimizer == "muon" else []
    taken = {id(p) for p in muon}
    rest = [(n, p) for n, p in named if id(p) not in taken]
    # Adapters are not decayed (as PEFT's recipes): decay would pull B A, the update itself, towards zero.
    groups = [
        {"params": [p for n, p in rest if p.dim() >= 2 and ".lora_" not in n], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in rest if p.dim() < 2 or ".lora_" in n], "weight_decay": 0.0},
    ]
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, **({"fused": True} if fused else {})}
    if muon:  # LoRA's adapters leave Muon nothing: AdamW alone trains them
        ns_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        hidden = Muon(muon, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, dtype=ns_dtype)
        return MuonAdamW(hidden, torch.optim.AdamW(groups, **kwargs), cfg.muon_lr / cfg.lr)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer: what the trainer, GradScaler and checkpoints see."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer, muon_lr_ratio: float) -> None:
        self.muon, self.adamw, self.muon_lr_ratio = muon, adamw, muon_lr_ratio

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    def set_lr(self, lr: float) -> None:
        """The schedule's lr for AdamW; Muon's keeps its configured ratio to it."""
        for group in self.muon.param_groups:
            group["lr"] = lr * self.muon_lr_ratio
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def step(self, closure=None) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError(f"expected a Muon + AdamW state, found keys {sorted(state)[:4]}")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def warmup_lr(step: int, max_lr: float, warmup_steps: int) -> float:
    """Linear warm-up: max_lr / warmup_steps at step 0, max_lr from step warmup_steps - 1 on."""
    return max_lr * (step + 1) / warmup_steps if step < warmup_steps else max_lr


def cosine_lr(step: int, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up to max_lr over warmup_steps, then cosine decay to min_lr at max_steps."""
    if step < warmup_steps:
        return warmup_lr(step, max_lr, warmup_steps)
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def wsd_lr(step: int, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int, decay_fraction: float) -> float:
    """Warm-up, stable at max_lr, then linear decay to min_lr over the last `decay_fraction` of the steps."""
    if step < warmup_steps:
        return warmup_lr(step, max_lr, warmup_steps)
    decay_start = max_steps - int(decay_fraction * max_steps)
    if step < decay_start:
        return max_lr
    progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return max_lr + progress * (min_lr - max_lr)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """The learning rate of `step` under the configured schedule."""
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return cosine_lr(step, cfg.lr, min_lr, cfg.warmup_steps, max_steps)
    if cfg.schedule == "wsd":
        return wsd_lr(step, cfg.lr, min_lr, cfg.warmup_steps, max_steps, cfg.decay_fraction)
    if cfg.schedule == "constant":
        return warmup_lr(step, cfg.lr, cfg.warmup_steps)
    raise GptforgeError(f"optim.schedule={cfg.schedule!r}: expected one of {', '.join(SCHEDULES)}")


def set_lr(optimizer: torch.optim.Optimizer | MuonAdamW, lr: float) -> float:
    """Set the schedule's lr (for MuonAdamW: AdamW's, Muon's in proportion); returns it for logging."""
    if isinstance(optimizer, MuonAdamW):
        optimizer.set_lr(lr)
        return lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
