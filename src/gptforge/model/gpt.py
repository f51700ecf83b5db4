"""GPT-2, faithfully: pre-LayerNorm blocks with biases, tanh-GELU, learned positions, tied embeddings.

Parameter names match OpenAI/Hugging Face GPT-2 so weight conversion is a key map plus Conv1D transposes.
The model holds no I/O, optimizer or distributed code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from gptforge.model.fused_loss import linear_cross_entropy


@dataclass
class GPTConfig:
    block_size: int = 1024
    """Context length: the largest sequence the position table covers."""
    vocab_size: int = 50257
    """Real vocabulary size; the embedding is padded past it for speed (see `vocab_multiple`)."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 768
    """Width of the residual stream."""
    vocab_multiple: int = 64
    """Pad the embedding rows to a multiple of this (50257 -> 50304); padded ids are never scored or sampled."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual outputs (0 for pretraining, as GPT-2 recipes do)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon (GPT-2's 1e-5; an imported model keeps its own)."""
    fused_loss: bool = True
    """Compute the cross-entropy together with lm_head, a chunk of rows at a time, so the full (tokens x vocab)
    logits never exist: less memory, same loss and gradients as the plain path."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them: less memory, ~30% more compute."""

    @property
    def padded_vocab_size(self) -> int:
        m = max(1, self.vocab_multiple)
        return (self.vocab_size + m - 1) // m * m


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding."""

    def __init__(self, cfg: GPTConfig, batch: int, device: torch.device) -> None:
        self.shape = (cfg.n_layer, 2, batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.device = device
        self.kv: torch.Tensor | None = None  # allocated at the first update, in the dtype autocast produces
        self.pos = 0  # positions filled

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's (B, nh, T, hs) keys/values; return all keys/values up to them."""
        if self.kv is None:
            self.kv = torch.zeros(self.shape, device=self.device, dtype=k.dtype)
        end = self.pos + k.size(2)
        self.kv[layer, 0, :, :, self.pos : end] = k
        self.kv[layer, 1, :, :, self.pos : end] = v
        return self.kv[layer, 0, :, :, :end], self.kv[layer, 1, :, :, :end]


EXPLICIT_ATTENTION_MAX_T = 512
"""On CPU, sequences up to this long use `explicit_causal_attention`: on a 2-core AVX512-BF16 CPU (torch 2.13) it
ran a bf16 forward+backward 1.4x (T=512) to 2.7x (T=128) faster than SDPA's CPU flash kernel, and 1.3x slower at
T=1024 (benchmarks/RESULTS.md). GPUs always use SDPA (flash attention)."""


def explicit_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, the softmax in fp32; the same result as SDPA with is_causal."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    att = F.dropout(torch.softmax(att.float(), dim=-1).to(q.dtype), dropout_p)
    return att @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"model.n_embd={cfg.n_embd} is not divisible by model.n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            if cache.pos and T > 1:
                raise ValueError("a KV cache takes one prompt (from position 0), then one token at a time")
            k, v = cache.update(layer, k, v)
        p = self.dropout if self.training else 0.0
        if x.device.type == "cpu" and 1 < T <= EXPLICIT_ATTENTION_MAX_T and cache is None:
            y = explicit_causal_attention(q, k, v, p)
        else:
            # A single new query attends to every cached position, so only a multi-token query needs the mask.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=T > 1)  # flash where available
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.padded_vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied input/output embedding
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), since each block adds two of them.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters with the real vocabulary, tied weights counted once (124,439,808 for `gpt2`)."""
        total = sum(p.numel() for p in self.parameters())
        return total - (self.config.padded_vocab_size - self.config.vocab_size) * self.config.n_embd

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per matmul weight plus attention scores."""
        cfg = self.config
        T = seq_len or cfg.block_size
        matmul_params = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.padded_vocab_size * cfg.n_embd
        return 6 * matmul_params + 6 * cfg.n_layer * cfg.n_embd * T

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits over the real vocabulary, mean cross-entropy in fp32 when targets are given).

        Logits are the last position's only, unless `all_logits`; with targets and no `all_logits` they are None
        (the loss is fused with lm_head). A `cache` continues from its position.
        """
        B, T = idx.shape
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.block_size={self.config.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for i, block in enumerate(self.transformer.h):
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache, i)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        V = self.config.vocab_size
        if targets is not None and self.config.fused_loss and not all_logits:
            return None, linear_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.reshape(-1), V)
        logits = self.lm_head(x if all_logits or targets is not None else x[:, [-1], :])[..., :V]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return (logits if all_logits else None), loss
