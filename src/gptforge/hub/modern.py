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
from gptforge.hub.foreign import check_supported, model_field, model_fields, shown
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
VOCAB_TABLES = ("transformer.wte.weight", "lm_head.weight")
LAYER = re.compile(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")

# model_type -> (architecture, hidden_act, qk_norm, MLP biases)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "silu", False, True),
    "qwen3": ("Qwen3ForCausalLM", "silu", True, False),
    "arcee": ("ArceeForCausalLM", "relu2", False, True),
    "apertus": ("ApertusForCausalLM", "relu2", True, False),
}
ACT_TO_MLP = {"silu": "swiglu", "relu2": "relu2"}
# config.json key -> the GPTConfig field it becomes (foreign.model_fields checks its type and range)
FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "n_embd",
    "intermediate_size": "mlp_hidden",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "block_size",
    "rms_norm_eps": "layer_norm_eps",
}
# transformers' defaults (its *Config classes) for what a config.json leaves out; sizes have none
HF_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu"),
    "qwen3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", head_dim=128),
    "arcee": dict(max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="relu2"),
    "apertus": dict(max_position_embeddings=65536, rms_norm_eps=1e-5, hidden_act="xielu", rope_theta=1.2e7),
}
DEFAULT_ROPE = {"apertus": {"rope_type": "llama3"}}  # what transformers puts in a null or missing rope_parameters
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


def option_text(key: str, value: Any) -> str:
    return f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"


def exports_as_gpt2(cfg: GPTConfig) -> bool:
    """GPT-2's components: zero_init only shapes the initial weights, so it does not change the architecture."""
    return replace(cfg, zero_init=False).is_gpt2


def model_type(cfg: GPTConfig) -> str:
    """The HF architecture a non-GPT-2 model exports to; anything it cannot be is one line naming the option."""
    if (cfg.norm, cfg.position, cfg.mlp) == ("layernorm", "learned", "gelu"):
        key = next(k for k, (value, _) in GPT2_HAS.items() if getattr(cfg, k) != value)
        raise GptforgeError(f"{option_text(key, getattr(cfg, key))}: {GPT2_HAS[key][1]}; {SUPPORTED}")
    for key, (value, why) in MODERN_NEEDS.items():
        if getattr(cfg, key) != value and not (key == "mlp" and cfg.mlp == "relu2"):
            raise GptforgeError(f"{option_text(key, getattr(cfg, key))}: {why}; {SUPPORTED}")
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


def hf_modules(module: str, cfg: GPTConfig) -> tuple[str, ...]:
    """The HF linear layers one of ours (`transformer.h.N.attn.c_attn`) splits into, its output rows in order."""
    return tuple(name.removesuffix(".weight") for name in _hf_names(f"{module}.weight", model_type(cfg)))


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
    """HF weights as `model`'s state dict (padded vocabulary rows zero); a missing, extra or misshapen tensor is one
    line. Only `model`'s shapes are read, so it may be on the meta device."""
    cfg, out, kind = model.config, {}, model_type(model.config)
    state = dict(state)
    if cfg.tie_embeddings:  # HF ties the head to the embedding, whatever the file holds (our export leaves it out)
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    for key, ours in model.state_dict().items():
        names = _hf_names(key, kind)
        rows = cfg.vocab_size if key in VOCAB_TABLES else len(ours) // len(names)
        parts = [state.pop(name, None) for name in names]
        for name, part in zip(names, parts, strict=True):
            if part is None:
                raise GptforgeError(f"{where}: weights do not match config.json (missing {name})")
            if part.shape != (rows, *ours.shape[1:]):
                expected = (rows, *ours.shape[1:])
                raise GptforgeError(
                    f"{where}: weights do not match config.json ({name} has shape {tuple(part.shape)}, "
                    f"config.json makes it {expected})"
                )
        value = torch.cat(parts)
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


def _rope_theta(config: dict[str, Any], kind: str, where: Path) -> float:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier; transformers prefers it): only the
    plain rotation of every dimension."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or DEFAULT_ROPE.get(kind, {})
    if not isinstance(rope, dict):
        raise GptforgeError(f"{where}: {key}={shown(rope)} (expected an object or null)")
    check_supported({f"{key}.rope_type": (rope.get("rope_type", rope.get("type", "default")), ("default",))}, where)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    check_supported({"partial_rotary_factor": (partial, (None, 1, 1.0))}, where)
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:  # a per-layer-type dict, a scaling factor: parameters of a rotation ours is not
        raise GptforgeError(f"{where}: {key} has {shown(extra[0])} (expected only rope_type and rope_theta)")
    theta_key = f"{key}.rope_theta" if "rope_theta" in rope else "rope_theta"
    return model_field(where, theta_key, rope.get("rope_theta", config["rope_theta"]), "rope_theta")


def _layers_checks(config: dict[str, Any], sizes: dict[str, int], where: Path) -> None:
    """What would make a layer compute other than ours: grouped-query attention, sliding windows."""
    heads, kv_heads = sizes["n_head"], config.get("num_key_value_heads")
    if kv_heads is not None and not (type(kv_heads) is int and kv_heads == heads):
        raise GptforgeError(
            f"{where}: num_key_value_heads={shown(kv_heads)} is not supported (grouped-query "
            f"attention: gptforge gives every one of num_attention_heads={heads} its own keys and values)"
        )
    layer_types = config.get("layer_types")
    full = isinstance(layer_types, list) and layer_types == ["full_attention"] * sizes["n_layer"]
    if layer_types is not None and not full:
        raise GptforgeError(
            f"{where}: layer_types={shown(layer_types)} is not supported (expected null or "
            f'num_hidden_layers={sizes["n_layer"]} times "full_attention": no sliding windows)'
        )


def gpt_config_from_hf(config: dict[str, Any], where: Path) -> GPTConfig:
    """Our model config for a Llama/Qwen3/Arcee/Apertus config.json; every field our model cannot compute is refused."""
    kind = config["model_type"]
    _, act, qk_norm, mlp_bias = ARCHITECTURES[kind]
    config = {"rope_theta": 10000.0, **HF_DEFAULTS[kind], **config}
    sizes = model_fields(config, FIELDS, where)
    if sizes["n_embd"] % sizes["n_head"]:  # before the checks below divide by it
        raise GptforgeError(
            f"{where}: num_attention_heads={sizes['n_head']} does not divide hidden_size={sizes['n_embd']} "
            "(each head gets hidden_size / num_attention_heads dimensions)"
        )
    _layers_checks(config, sizes, where)
    bias = config.get("attention_bias", False)
    checks = {
        "head_dim": (config.get("head_dim"), (None, sizes["n_embd"] // sizes["n_head"])),
        "hidden_act": (config["hidden_act"], (act,)),
        "attention_bias": (bias, (False, True) if mlp_bias else (False,)),  # ours puts biases in the MLP too
        "mlp_bias": (config.get("mlp_bias", False) if mlp_bias else bias, (bias,)),
        "use_sliding_window": (config.get("use_sliding_window", False), (False,)),
        "tie_word_embeddings": (config.get("tie_word_embeddings", False), (False, True)),
        "architectures": (config.get("architectures"), (None, [ARCHITECTURES[kind][0]])),
    }
    check_supported(checks, where)
    cfg = GPTConfig(
        **sizes,
        norm="rmsnorm",
        position="rotary",
        rope_theta=_rope_theta(config, kind, where),
        qk_norm=qk_norm,
        bias=bias,
        tie_embeddings=config.get("tie_word_embeddings", False),
        mlp=ACT_TO_MLP[act],
    )
    if cfg.mlp_hidden == replace(cfg, mlp_hidden=0).hidden_size:  # the default width, as our export writes it
        cfg = replace(cfg, mlp_hidden=0)
    return validate(Config(model=cfg), str(where)).model
