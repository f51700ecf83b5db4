"""AdamW with GPT-3 parameter groups (or Muon for the hidden matrices beside it), and learning-rate schedules as
pure functions."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

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


def wsd_lr(
    step: float, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int, decay_fraction: float
) -> float:
    """Warm-up, stable at max_lr, then linear decay to min_lr over the last `decay_fraction` of the steps."""
    if step < warmup_steps:
        return warmup_lr(step, max_lr, warmup_steps)
    decay_start = max_steps - int(decay_fraction * max_steps)
    if step < decay_start:
        return max_lr
    progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return max_lr + progress * (min_lr - max_lr)


def lr_at(step: int, cfg: OptimConfig, max_steps: int, progress: float | None = None) -> float:
    """The learning rate of `step` under the configured schedule; `progress` (0 to 1 through the steps after warm-up)
    stands for (step - warmup) / (max_steps - warmup) where a re-planned step count moved it (`Decay`)."""
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule not in SCHEDULES:
        raise GptforgeError(f"optim.schedule={cfg.schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if cfg.schedule == "constant" or step < cfg.warmup_steps:
        return warmup_lr(step, cfg.lr, cfg.warmup_steps)
    position = step  # wsd's: a step of this plan
    if progress is None:
        progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    else:
        position = cfg.warmup_steps + progress * max(1, max_steps - cfg.warmup_steps)
    if progress >= 1:
        return min_lr
    if cfg.schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)
    return wsd_lr(position, cfg.lr, min_lr, cfg.warmup_steps, max_steps, cfg.decay_fraction)


@dataclass
class Decay:
    """The schedule under a step count that a time budget plans again. The progress through the decay is anchored
    where the plan last changed and spread over the steps the new plan leaves, to the last step's progress under
    that plan: a re-plan bends the curve, never raises the rate (the lowest rate given after warm-up is a ceiling,
    whatever the schedule's shape), and the last step runs at its plan's last rate. With one plan it is `lr_at`."""

    step: int = 0
    """The step the progress was last anchored at."""
    progress: float = 0.0
    """The progress at that step."""
    plan: int = 0
    """The step count it was anchored under (0: not yet)."""
    lowest: float = math.inf
    """The lowest rate given after warm-up."""

    def lr(self, step: int, cfg: OptimConfig, max_steps: int) -> float:
        warmup = cfg.warmup_steps
        if self.plan == 0 or step < warmup:  # the decay starts after warm-up, under the plan of then
            self.step, self.progress, self.plan = warmup, 0.0, max_steps
        elif max_steps != self.plan:  # the progress under the old plan, then spread over the new one's steps
            progress = self._progress(step, warmup)
            if progress is None:
                progress = (step - warmup) / max(1, self.plan - warmup)
            self.step, self.progress, self.plan = step, progress, max_steps
        if step < warmup:
            return lr_at(step, cfg, max_steps)
        self.lowest = min(self.lowest, lr_at(step, cfg, max_steps, self._progress(step, warmup)))
        return self.lowest

    def _progress(self, step: int, warmup: int) -> float | None:
        """The progress of `step` under the anchored plan (None: one plan since warm-up, lr_at's own)."""
        if (self.step, self.progress) == (warmup, 0.0):
            return None if step < self.plan else 1.0
        last = self.plan - 1
        final = (last - warmup) / max(1, self.plan - warmup)  # what lr_at gives the last step of this plan
        if step >= last:
            return final if step == last else 1.0
        return self.progress + (step - self.step) * (final - self.progress) / (last - self.step)

    def state_dict(self) -> dict[str, float]:
        return {"step": self.step, "progress": self.progress, "plan": self.plan, "lowest": self.lowest}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.step, self.progress, self.plan = int(state["step"]), state["progress"], int(state["plan"])
        self.lowest = math.inf if state["lowest"] is None else state["lowest"]


def set_lr(optimizer: torch.optim.Optimizer | MuonAdamW, lr: float) -> float:
    """Set the schedule's lr (for MuonAdamW: AdamW's, Muon's in proportion); returns it for logging."""
    if isinstance(optimizer, MuonAdamW):
        optimizer.set_lr(lr)
        return lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
