"""Weight-only int8 for inference: each linear layer's weight as int8 with one scale per output row, the
activations in bf16. A decoded token streams every weight from memory once, so a quarter of the bytes is most of
a CPU's decode time (the demo model: 0.30 ms a token compiled, against 1.25 in float32)."""

from __future__ import annotations

import torch
from torch import nn

from gptforge.model.gpt import GPT

WEIGHTS = ("float", "int8")  # how an inference model holds its linear weights


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 rows times a bf16 scale each (symmetric, the row's largest magnitude at
    127); its bias, if any, stays as it was. Inference only: there is nothing to train."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", (w / scale[:, None]).round().to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        # torch's int8 x bf16 CPU kernel reads the int8 weight as it is; it takes rows of 16n values (others crashed)
        self.packed = self.in_features % 16 == 0 and hasattr(torch, "_weight_int8pack_mm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.packed and x.device.type == "cpu":
            y = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scale)
        else:
            y = rows @ (self.qweight.to(torch.bfloat16) * self.scale[:, None]).t()
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@torch.no_grad()
def quantize_int8(model: GPT) -> GPT:
    """Replace every linear layer of `model` by an Int8Linear, in place; the embedding table stays as it is (a tied
    lm_head gets an int8 copy of it)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
    return model
