"""Low-rank adapters (Hu et al. 2021, LoRA): y = x W^T + b + (alpha / r) * dropout(x) A^T B^T, W and b frozen.

`B` starts at zero, as PEFT does, so a model with fresh adapters computes exactly the base model. The adapted
layers keep their base parameters under the same names (`...c_attn.weight`), so a base checkpoint loads into an
adapted model unchanged and the adapters add `lora_A` / `lora_B` beside them, in PEFT's shapes ((r, in), (out, r)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """An nn.Linear whose weight and bias are frozen and whose output gains a trainable low-rank update."""

    def __init__(self, base: nn.Linear, spec: LoRASpec) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same tensors: shared storage, names unchanged
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scaling = spec.scaling
        self.lora_dropout = nn.Dropout(spec.dropout)
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(spec.rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, spec.rank, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's and nn.Linear's default
        self.train(base.training)  # a new module starts in training mode: an eval model would drop out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A: the plain layer that computes what this one does (without dropout)."""
        return self.weight + self.scaling * (self.lora_B @ self.lora_A).to(self.weight.dtype)


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Replace every linear layer whose name ends with one of `spec.targets` by a LoRALinear and freeze every other
    parameter; returns the adapted layers' names (an empty list is the caller's error to report)."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, LoRALinear) and name.endswith(spec.targets):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, LoRALinear(module, spec))
            adapted.append(name)
    return adapted


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge_lora(model: nn.Module, merge: bool = True) -> nn.Module:
    """Put plain nn.Linear layers back, each adapter folded into its weight (`merge`) or dropped (the base model
    again): the model then exports as any other."""
    for name, layer in lora_layers(model).items():
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        plain.to(device=layer.weight.device, dtype=layer.weight.dtype)
        plain.weight.copy_(layer.merged_weight() if merge else layer.weight)
        if layer.bias is not None:
            plain.bias.copy_(layer.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, plain.train(layer.training))
    return model
