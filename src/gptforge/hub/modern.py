"""Hugging Face interop for the modern block: Llama (SwiGLU), Qwen3 (SwiGLU + QK-norm), Arcee (ReLU², no gate),
Apertus (ReLU² + QK-norm).

The four are one decoder under different names: RMSNorm, rotary in HF's half-split layout, separate q/k/v and
gate/up projections. Ours stacks q|k|v in `c_attn` and gate|up in `c_fc` along the output dim, so one key map
(shared by export and import) names the pieces each fused weight splits into. The vocabulary padding stays here.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gptforge.config import Config, validate
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT, GPTConfig

LAYER_KEYS = {
    "ln_1": ("input_layernorm",),
    "attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.q_norm": ("self_attn.q_norm",),
    "attn.k_norm": ("self_attn.k_norm",),
    "attn.c_proj": ("self_attn.o_proj",),
    "ln_2": ("post_attention_layernorm",),
    "mlp.c_fc": ("mlp.gate_proj", "mlp.up_proj"),  # swiglu; relu2's c_fc is up_proj alone (UP_ONLY)
    "mlp.c_proj": ("mlp.down_proj",),
}
UP_ONLY = ("mlp.up_proj",)
APERTUS_NORMS = {"ln_1": ("attention_layernorm",), "ln_2": ("feedforward_layernorm",)}
TOP_KEYS = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm", "lm_head": "lm_head"}
LAYER = re.compile(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")

# model_type -> (architecture, hidden_act, qk_norm, MLP biases)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "silu", False, True),
    "qwen3": ("Qwen3ForCausalLM", "silu", True, False),
    "arcee": ("ArceeForCausalLM", "relu2", False, True),
    "apertus": ("ApertusForCausalLM", "relu2", True, False),
}
ACT_TO_MLP = {"silu": "swiglu", "relu2": "relu2"}
SUPPORTED = "export supports gpt2 models and modern ones (rmsnorm, rotary, swiglu or relu2)"
MODERN_NEEDS = {
    "norm": ("rmsnorm", "Llama/Qwen3 use RMSNorm"),
    "position": ("rotary", "Llama/Qwen3 use rotary positions"),
    "mlp": ("swiglu", "Llama/Qwen3 gate their MLP (swiglu), Arcee/Apertus square a ReLU (relu2): none has GELU"),
}
GPT2_HAS = {
    "qk_norm": (False, "GPT2LMHeadModel has no QK-norm"),
    "bias": (True, "GPT2LMHeadModel has biases"),
    "tie_embeddings": (True, "GPT2LMHeadModel ties its output layer to the token embedding"),
}


def _option(key: str, value: Any) -> str:
    return f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"


def exports_as_gpt2(cfg: GPTConfig) -> bool:
    """GPT-2's components: zero_init only shapes the initial weights, so it does not change the architecture."""
    return replace(cfg, zero_init=False).is_gpt2


def model_type(cfg: GPTConfig) -> str:
    """The HF architecture a non-GPT-2 model exports to; anything it cannot be is one line naming the option."""
    if (cfg.norm, cfg.position, cfg.mlp) == ("layernorm", "learned", "gelu"):
        key = next(k for k, (value, _) in GPT2_HAS.items() if getattr(cfg, k) != value)
        raise GptforgeError(f"{_option(key, getattr(cfg, key))}: {GPT2_HAS[key][1]}; {SUPPORTED}")
    for key, (value, why) in MODERN_NEEDS.items():
        if getattr(cfg, key) != value and not (key == "mlp" and cfg.mlp == "relu2"):
            raise GptforgeError(f"{_option(key, getattr(cfg, key))}: {why}; {SUPPORTED}")
    if cfg.qk_norm and cfg.bias:
        raise GptforgeError(
            "model.bias=true with model.qk_norm=true: Qwen3 and Apertus have no MLP biases; " + SUPPORTED
        )
    if cfg.mlp == "relu2":
        return "apertus" if cfg.qk_norm else "arcee"
    return "qwen3" if cfg.qk_norm else "llama"


def _hf_names(key: str, kind: str) -> tuple[str, ...]:
    """The HF parameters one of ours splits into (row blocks, in order) in architecture `kind`."""
    match = LAYER.match(key)
    if match is None:
        module, param = key.rsplit(".", 1)
        return (f"{TOP_KEYS[module]}.{param}",)
    layer, module, param = match.groups()
    parts = UP_ONLY if module == "mlp.c_fc" and ARCHITECTURES[kind][1] == "relu2" else LAYER_KEYS[module]
    parts = APERTUS_NORMS.get(module, parts) if kind == "apertus" else parts
    return tuple(f"model.layers.{layer}.{part}.{param}" for part in parts)


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under HF names: fused projections split, real vocabulary, tied head left out (HF re-ties it)."""
    cfg, out, kind = model.config, {}, model_type(model.config)
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if key in ("transformer.wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        names = _hf_names(key, kind)
        for name, part in zip(names, value.chunk(len(names)), strict=True):
            out[name] = part.detach().to("cpu").contiguous()
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], model: GPT, where: Path) -> dict[str, torch.Tensor]:
    """HF weights as `model`'s state dict (padded vocabulary rows zero); a missing or extra tensor is one line."""
    cfg, out, kind = model.config, {}, model_type(model.config)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # older HF saved it
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    for key, ours in model.state_dict().items():
        names = _hf_names(key, kind)
        missing = [n for n in names if state.get(n) is None]
        if missing:
            raise GptforgeError(f"{where}: weights do not match config.json (missing {missing[0]})")
        value = torch.cat([state.pop(n) for n in names])
        if value.shape[1:] != ours.shape[1:] or len(value) > len(ours):
            raise GptforgeError(f"{where}: weights do not match config.json ({names[0]}: {tuple(value.shape)})")
        if len(value) < len(ours):  # the padded vocabulary rows
            value = torch.cat([value, value.new_zeros(len(ours) - len(value), *value.shape[1:])])
        out[key] = value.contiguous()
    if state:
        raise GptforgeError(f"{where}: weights do not match config.json (unexpected {sorted(state)[0]})")
    return out


def hf_config(cfg: GPTConfig, eot: int) -> dict[str, Any]:
    """config.json of the HF model equal to ours (dropout, a training-time choice, is not kept)."""
    kind = model_type(cfg)
    architecture, act, _, mlp_bias = ARCHITECTURES[kind]
    config = {
        "architectures": [architecture],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,
        "head_dim": cfg.n_embd // cfg.n_head,
        "hidden_act": act,
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.layer_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }
    if mlp_bias:
        config["mlp_bias"] = cfg.bias
    if kind == "qwen3":  # its defaults would turn on a sliding window past max_window_layers
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
        config["layer_types"] = ["full_attention"] * cfg.n_layer
    if kind == "apertus":  # its defaults: token 3 pads
        config["pad_token_id"] = None
    return config


def _rope_theta(config: dict[str, Any], where: Path) -> float:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier): only the plain rotation."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind != "default":
        raise GptforgeError(f"{where}: rope_type={kind!r} is not supported (expected 'default': no rope scaling)")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise GptforgeError(f"{where}: rope_theta={theta!r} (expected a positive number)")
    return float(theta)


def gpt_config_from_hf(config: dict[str, Any], where: Path) -> GPTConfig:
    """Our model config for a Llama/Qwen3/Arcee/Apertus config.json; every field our model cannot compute is refused."""
    kind = config["model_type"]
    _, act, qk_norm, mlp_bias = ARCHITECTURES[kind]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GptforgeError(f"{where}: {key}={value!r} (expected a positive integer)")
    heads, width = config["num_attention_heads"], config["hidden_size"]
    if config.get("num_key_value_heads") not in (None, heads):
        raise GptforgeError(
            f"{where}: num_key_value_heads={config['num_key_value_heads']!r} is not supported (grouped-query "
            f"attention: gptforge gives every one of num_attention_heads={heads} its own keys and values)"
        )
    bias = config.get("attention_bias", False)
    layer_types = set(config.get("layer_types") or ["full_attention"])
    checks = {
        "head_dim": (config.get("head_dim"), {None, width // heads}),
        "hidden_act": (config.get("hidden_act", "xielu" if kind == "apertus" else act), {act}),
        "mlp_bias": (config.get("mlp_bias", False) if mlp_bias else bias, {bias}),
        "attention_bias": (bias, {False, True} if mlp_bias else {False}),  # ours puts biases in the MLP too
        "use_sliding_window": (config.get("use_sliding_window", False), {False}),
        "layer_types": (sorted(layer_types), [["full_attention"]]),
        "tie_word_embeddings": (config.get("tie_word_embeddings", False), {False, True}),
    }
    for key, (value, allowed) in checks.items():
        if value not in allowed:
            raise GptforgeError(
                f"{where}: {key}={value!r} is not supported (expected one of {sorted(map(str, allowed))})"
            )
    cfg = GPTConfig(
        block_size=config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"],
        n_head=heads,
        n_embd=width,
        layer_norm_eps=config.get("rms_norm_eps", 1e-6),
        norm="rmsnorm",
        position="rotary",
        rope_theta=_rope_theta(config, where),
        qk_norm=qk_norm,
        bias=bias,
        tie_embeddings=config.get("tie_word_embeddings", False),
        mlp=ACT_TO_MLP[act],
    )
    if cfg.hidden_size != config["intermediate_size"]:  # 0 (the default width) when it is, as our export wrote it
        cfg = replace(cfg, mlp_hidden=config["intermediate_size"])
    return validate(Config(model=cfg), str(where)).model
