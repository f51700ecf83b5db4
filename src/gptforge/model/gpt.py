"""GPT-2, faithfully (pre-LayerNorm blocks with biases, tanh-GELU, learned positions, tied embeddings), and an
opt-in modern block chosen field by field: RMSNorm, rotary positions, QK-norm, no biases, untied embeddings, a SwiGLU
or ReLU² MLP, zero-initialised output projections.

Parameter names match OpenAI/Hugging Face GPT-2 so weight conversion is a key map plus Conv1D transposes (the modern
block keeps those names; hub/ maps them to Llama/Qwen3). The model holds no I/O, optimizer or distributed code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from gptforge.model.fused_loss import linear_cross_entropy
from gptforge.model.kv_cache import KVCache, RowCache, StaticCache


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
    """Epsilon of every LayerNorm/RMSNorm (GPT-2's 1e-5; an imported model keeps its own)."""
    norm: str = "layernorm"
    """layernorm (GPT-2: gain and bias) or rmsnorm (gain only)."""
    position: str = "learned"
    """learned (GPT-2's position table, `wpe`) or rotary (RoPE on queries and keys, no table)."""
    rope_theta: float = 10000.0
    """Rotary base: the slowest rotation's period in tokens, roughly."""
    qk_norm: bool = False
    """RMSNorm each head's queries and keys (with a gain) before attention: bounded logits, steadier at high lr."""
    bias: bool = True
    """Biases in the linear layers (GPT-2 has them; modern models drop them)."""
    tie_embeddings: bool = True
    """lm_head shares the token embedding's weights (GPT-2); false gives the output layer its own."""
    mlp: str = "gelu"
    """gelu (GPT-2: tanh-GELU), swiglu (SiLU-gated, as Llama/Qwen) or relu2 (squared ReLU, as modded-nanogpt)."""
    mlp_hidden: int = 0
    """MLP width (0: 4 * n_embd; for swiglu 8/3 * n_embd rounded up to a multiple of 64: the same parameters)."""
    zero_init: bool = False
    """Start the residual output projections (and an untied lm_head) at zero: each block begins as the identity."""
    fused_loss: bool = True
    """Compute the cross-entropy together with lm_head, a chunk of rows at a time, so the full (tokens x vocab)
    logits never exist: less memory, same loss and gradients as the plain path."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them: less memory, ~30% more compute."""
    document_token: int = -1
    """In training and evaluation rows, the token that ends each packed document (EOT): each document then starts
    at position 0 and attends only to itself, as it would alone, and targets < 0 leave the loss. Fine-tuning on
    conversations sets it; -1: rows are one stream (pretraining)."""

    @property
    def padded_vocab_size(self) -> int:
        m = max(1, self.vocab_multiple)
        return (self.vocab_size + m - 1) // m * m

    @property
    def hidden_size(self) -> int:
        """The MLP's inner width (per branch for swiglu)."""
        if self.mlp_hidden:
            return self.mlp_hidden
        return -(-8 * self.n_embd // 192) * 64 if self.mlp == "swiglu" else 4 * self.n_embd

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per matmul weight plus attention scores."""
        T = seq_len or self.block_size
        mlp = (3 if self.mlp == "swiglu" else 2) * self.n_embd * self.hidden_size
        matmul_params = self.n_layer * (4 * self.n_embd**2 + mlp) + self.padded_vocab_size * self.n_embd
        return 6 * matmul_params + 6 * self.n_layer * self.n_embd * T

    @property
    def num_weights(self) -> int:
        """Parameters a model of this config holds (padded vocabulary, tied weights once), without building it."""
        C, H, bias = self.n_embd, self.hidden_size, int(self.bias)
        norm = C if self.norm == "rmsnorm" else C * (1 + bias)
        branches = 2 if self.mlp == "swiglu" else 1
        attn = 4 * C * C + 4 * C * bias + (2 * (C // self.n_head) if self.qk_norm else 0)
        mlp = (branches + 1) * H * C + branches * H * bias + C * bias
        tables = (1 if self.tie_embeddings else 2) * self.padded_vocab_size * C
        positions = self.block_size * C if self.position == "learned" else 0
        return tables + positions + self.n_layer * (2 * norm + attn + mlp) + norm

    @property
    def is_gpt2(self) -> bool:
        """Every component is GPT-2's (the `gpt2*` presets)."""
        parts = (self.norm, self.position, self.qk_norm, self.bias, self.tie_embeddings, self.mlp, self.zero_init)
        return parts == ("layernorm", "learned", False, True, True, "gelu", False)


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}


EXPLICIT_ATTENTION_MAX_T = 512
"""On CPU, sequences up to this long use `explicit_causal_attention`: on a 2-core AVX512-BF16 CPU (torch 2.13) it
ran a bf16 forward+backward 1.4x (T=512) to 2.7x (T=128) faster than SDPA's CPU flash kernel, and 1.3x slower at
T=1024 (benchmarks/RESULTS.md). GPUs always use SDPA (flash attention)."""


def explicit_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, the softmax in fp32; the same result as SDPA with is_causal.
    `allowed` (B, 1, T, T), when given, replaces the causal mask (documents packed in a row)."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    blocked = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1) if allowed is None else ~allowed
    att = att.masked_fill(blocked, float("-inf"))
    att = F.dropout(torch.softmax(att.float(), dim=-1).to(q.dtype), dropout_p)
    return att @ v


class RMSNorm(nn.RMSNorm):
    """RMSNorm computed in fp32 (as Llama/Qwen3 do), returned in the input's dtype: under bf16 autocast a bf16 input
    with an fp32 gain would miss torch's fused kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight, self.eps).type_as(x)


def norm_layer(cfg: GPTConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(dim, eps=cfg.layer_norm_eps, bias=cfg.bias)


def rotary_tables(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, (block_size, head_dim), in the half-split layout HF uses."""
    hs = cfg.n_embd // cfg.n_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def document_mask(docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of packed documents (B, T) of nondecreasing ids: each token's position inside its document, and
    which keys each query may see (B, 1, T, T): earlier tokens of its own document only."""
    T = docs.size(1)
    index = torch.arange(T, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    same = docs[:, :, None] == docs[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return positions, (same & causal)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, T, hs) by each position's angles: pairs (i, i + hs/2) turn together."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"model.n_embd={cfg.n_embd} is not divisible by model.n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.n_embd // cfg.n_head, eps=cfg.layer_norm_eps)
            self.k_norm = RMSNorm(cfg.n_embd // cfg.n_head, eps=cfg.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope=None,
        cache: KVCache | RowCache | StaticCache | None = None,
        layer: int = 0,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        k = k.view(B, T, self.n_head, C // self.n_head)  # (B, T, nh, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        p = self.dropout if self.training else 0.0
        if isinstance(cache, RowCache | StaticCache):
            y = cache.attend(q, k, v)
        elif allowed is not None and x.device.type == "cpu":
            y = explicit_causal_attention(q, k, v, p, allowed)
        elif allowed is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)
        elif x.device.type == "cpu" and 1 < T <= EXPLICIT_ATTENTION_MAX_T and cache is None:
            y = explicit_causal_attention(q, k, v, p)
        else:
            # A single new query attends to every cached position, so only a multi-token query needs causality.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=T > 1)  # flash where available
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        branches = 2 if cfg.mlp == "swiglu" else 1  # swiglu's c_fc holds the gate, then the up projection
        self.c_fc = nn.Linear(cfg.n_embd, branches * cfg.hidden_size, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm_layer(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm_layer(cfg, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope=None,
        cache: KVCache | RowCache | StaticCache | None = None,
        layer: int = 0,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, cache, layer, allowed)
        return x + self.mlp(self.ln_2(x))


CHOICES = {"norm": ("layernorm", "rmsnorm"), "position": ("learned", "rotary"), "mlp": ("gelu", "swiglu", "relu2")}


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        for key, allowed in CHOICES.items():
            if getattr(cfg, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(cfg, key)!r}: expected one of {', '.join(allowed)}")
        self.config = cfg
        layers = dict(wte=nn.Embedding(cfg.padded_vocab_size, cfg.n_embd))
        if cfg.position == "learned":
            layers["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        layers.update(drop=nn.Dropout(cfg.dropout), h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)))
        self.transformer = nn.ModuleDict(dict(**layers, ln_f=norm_layer(cfg, cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # tied input/output embedding
        if cfg.position == "rotary":  # derived from the config, so neither saved nor loaded
            cos, sin = rotary_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), since each block adds two of them.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
                if cfg.zero_init:
                    nn.init.zeros_(p)
        if cfg.zero_init and not cfg.tie_embeddings:
            nn.init.zeros_(self.lm_head.weight)

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
        cfg = self.config
        total = sum(p.numel() for p in self.parameters())
        padded_tables = 1 if cfg.tie_embeddings else 2
        return total - padded_tables * (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per matmul weight plus attention scores."""
        return self.config.flops_per_token(seq_len)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | RowCache | StaticCache | None = None,
        all_logits: bool = False,
        docs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits over the real vocabulary, mean cross-entropy in fp32 when targets are given).

        Logits are the last position's only, unless `all_logits`; with targets and no `all_logits` they are None
        (the loss is fused with lm_head). A `cache` continues from its position (a RowCache: each row from its own).
        `docs` (B, T) packs documents in a row: each starts at position 0 and sees only itself, and targets < 0
        are left out of the loss (its mean over the rest; 0 where nothing is left).
        """
        B, T = idx.shape
        end = (cache.length if cache is not None else 0) + T
        if end > self.config.block_size:
            raise ValueError(f"sequence of {end} tokens exceeds model.block_size={self.config.block_size}")
        allowed = None
        if docs is None and targets is not None and cache is None and self.config.document_token >= 0:
            ends = idx == self.config.document_token  # an end belongs to the document it ends
            docs = torch.cumsum(ends, dim=1) - ends.long()
        if docs is not None:
            pos, allowed = document_mask(docs)
        elif cache is not None:
            pos = cache.positions(T, idx.device)
        else:
            pos = torch.arange(T, device=idx.device)
        x, rope = self.transformer.wte(idx), None
        if self.config.position == "learned":
            x = x + self.transformer.wpe(pos)
        elif pos.dim() == 1:
            rope = (self.rope_cos[end - T : end], self.rope_sin[end - T : end])
        else:  # per-row positions (B, T): (B, 1, T, hs) tables, one per row, broadcast over the heads
            rope = (self.rope_cos[pos][:, None], self.rope_sin[pos][:, None])
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, rope, None, i, allowed, use_reentrant=False)
            else:
                x = block(x, rope, cache, i, allowed)
        if cache is not None:
            cache.advance(T)
        x = self.transformer.ln_f(x)
        V = self.config.vocab_size
        if targets is not None and docs is not None:
            return self._masked_loss(x, targets, all_logits)
        if targets is not None and self.config.fused_loss and not all_logits:
            return None, linear_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.reshape(-1), V)
        logits = self.lm_head(x if all_logits or targets is not None else x[:, [-1], :])[..., :V]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return (logits if all_logits else None), loss

    def _masked_loss(self, x: torch.Tensor, targets: torch.Tensor, all_logits: bool):
        """Mean cross-entropy over the targets >= 0 alone: only their rows reach lm_head."""
        keep = targets.reshape(-1) >= 0
        rows, kept = x.reshape(-1, x.size(-1))[keep], targets.reshape(-1)[keep]
        V = self.config.vocab_size
        if self.config.fused_loss:
            loss = linear_cross_entropy(rows, self.lm_head.weight, kept, V) if len(kept) else None
        else:
            loss = F.cross_entropy(self.lm_head(rows)[..., :V].float(), kept) if len(kept) else None
        if loss is None:  # nothing to learn in this batch: a zero that still reaches every parameter's graph
            loss = (x.sum() + self.lm_head.weight.sum()).float() * 0.0
        logits = self.lm_head(x)[..., :V] if all_logits else None
        return logits, loss
