"""GGUF export for llama.cpp and the tools built on it (Ollama, LM Studio): weights, hyperparameters and the
tokenizer in one file, written with llama.cpp's own `gguf` package.

The GPT-2 block becomes llama.cpp's `gpt2`; the modern block `llama`, `qwen3` (QK-norm), `arcee` (ReLU²) or
`apertus` (ReLU² and QK-norm: its xIELU, with the right constants, is ReLU²), as hub/modern.py names it for
Hugging Face. llama.cpp's `llama` and `arcee` rotate adjacent pairs while ours (and
HF's) rotate the halves of each head, so their query and key rows are permuted on the way out; `qwen3` keeps ours.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gptforge.errors import GptforgeError
from gptforge.files import stale_temp_files, usual_mode, writing
from gptforge.hub import GGUF_FILE_TYPES, modern
from gptforge.hub.convert import gpt2_vocab_and_merges
from gptforge.inputs import printable
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.chat import added_tokens, chat_template
from gptforge.tokens.fim import Sentinels
from gptforge.tokens.tokenizer import EOT_TEXT, Tokenizer

if TYPE_CHECKING:
    import gguf

INTERLEAVED_ROPE = ("llama", "arcee")
OUTPUT_REQUIRED = ("apertus",)  # llama.cpp's apertus reads output.weight even when it is token_embd's copy
# xIELU is alpha_p x² + beta x for x > 0, and (expm1(min(x, eps)) - x) alpha_n + beta x below; ggml takes alpha_p and
# alpha_n before their softplus, as HF's parameters are stored: softplus(log(e - 1)) = 1, softplus(-1e4) = 0 in f32.
RELU2_AS_XIELU = {"alpha_p": math.log(math.e - 1), "alpha_n": -1e4, "beta": 0.0, "eps": -1e-6}
LAYER_NAMES = {  # our module -> llama.cpp's tensor, in the modern block (c_attn and c_fc are split first)
    "ln_1": "attn_norm",
    "attn.q": "attn_q",
    "attn.k": "attn_k",
    "attn.v": "attn_v",
    "attn.q_norm": "attn_q_norm",
    "attn.k_norm": "attn_k_norm",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.gate": "ffn_gate",
    "mlp.up": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
GPT2_LAYER_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                    "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}  # fmt: skip
TOP_NAMES = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm",
             "lm_head": "output"}  # fmt: skip
GPT2_NEEDS = {"bias": (True, "llama.cpp's gpt2 has biases"), "qk_norm": (False, "llama.cpp's gpt2 has no QK-norm")}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5  # gguf.TokenType, without importing gguf to name them


@dataclass
class GGUFVocab:
    """What llama.cpp's BPE needs: tokens in id order (byte-level strings), their types, and 'a b' merges."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    eot: int
    fim: Sentinels | None = None
    """Fill-in-the-middle sentinels (a run with data.fim_rate): llama.cpp's /infill and editor plugins use them."""
    chat_end: int | None = None
    """A chat model's <|im_end|>: llama.cpp ends a reply there."""
    chat_jinja: str | None = None
    """A chat model's template, with which llama.cpp formats messages."""


def gguf_arch(cfg: GPTConfig) -> str:
    """llama.cpp's architecture for `cfg`; a block it has no counterpart for is one line naming the option."""
    if (cfg.norm, cfg.position, cfg.mlp) == ("layernorm", "learned", "gelu"):
        for key, (value, why) in GPT2_NEEDS.items():
            if getattr(cfg, key) != value:
                raise GptforgeError(f"{modern.option_text(key, getattr(cfg, key))}: {why}; no GGUF architecture fits")
        return "gpt2"
    kind = modern.model_type(cfg)
    if kind == "arcee" and cfg.bias:
        raise GptforgeError("model.bias=true with model.mlp=relu2: llama.cpp's arcee has no biases")
    return kind


def gguf_vocab(tokenizer: Tokenizer, vocab_size: int) -> GGUFVocab:
    """The tokenizer as llama.cpp's `gpt2` BPE with GPT-2's pre-tokenization; the model's rows past the tokenizer's
    vocabulary (an imported model's padding) become unused placeholder tokens, as llama.cpp's converter writes."""
    if tokenizer.path is None:
        vocab, merges = gpt2_vocab_and_merges()
    else:
        vocab, merges = _byte_level_bpe(tokenizer.path)
    added = added_tokens(tokenizer)  # FIM's sentinels, the chat template's tokens
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))) or len(tokens) + len(added) > vocab_size:
        raise GptforgeError(
            f"tokenizer {tokenizer.path or tokenizer.name}: ids are not 0..{len(tokens) - 1} within the model's "
            f"{vocab_size:,} rows"
        )
    types = [TOKEN_CONTROL if t == EOT_TEXT else TOKEN_NORMAL for t in tokens]
    tokens, types = tokens + list(added.values()), types + [TOKEN_CONTROL] * len(added)
    padding = range(len(tokens), vocab_size)
    return GGUFVocab(
        tokens=tokens + [f"[PAD{i}]" for i in padding],
        types=types + [TOKEN_UNUSED for _ in padding],
        merges=merges,
        eot=tokenizer.eot,
        fim=getattr(tokenizer, "sentinels", None),
        chat_end=tokenizer.im_end if (template := chat_template(tokenizer)) else None,
        chat_jinja=template.jinja if template else None,
    )


def _byte_level_bpe(path: Path) -> tuple[dict[str, int], list[str]]:
    """Vocabulary and merges of a tokenizers JSON file that tokenizes as GPT-2 does (byte-level BPE, GPT-2's
    pre-tokenization regex), which is all llama.cpp's 'gpt-2' pre-tokenizer reproduces."""
    data = json.loads(path.read_text(encoding="utf-8"))
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
    if model.get("type") != "BPE" or not byte_level or data.get("normalizer"):
        raise GptforgeError(
            f"{path}: GGUF export needs a byte-level BPE with GPT-2's pre-tokenization (as `prepare "
            "--train-tokenizer` makes); this tokenizer is another kind"
        )
    vocab = dict(model["vocab"])
    for added in data.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    return vocab, merges


def gguf_tensors(model: GPT, arch: str) -> dict[str, torch.Tensor]:
    """Our weights under llama.cpp's names, float32, the real vocabulary only; a tied head is left out where
    llama.cpp reads token_embd in its place."""
    cfg, out = model.config, {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_embeddings:
            continue
        value = value.detach().to("cpu", torch.float32)
        if key in ("transformer.wte.weight", "lm_head.weight"):
            value = value[: cfg.vocab_size]
        module, param = key.rsplit(".", 1)
        if not module.startswith("transformer.h."):
            out[f"{TOP_NAMES[module]}.{param}"] = value
            continue
        layer, name = module.removeprefix("transformer.h.").split(".", 1)
        for part, piece in _split(name, value, cfg, arch).items():
            names = GPT2_LAYER_NAMES if arch == "gpt2" else LAYER_NAMES
            out[f"blk.{layer}.{names[part]}.{param}"] = piece
    if arch in OUTPUT_REQUIRED and "output.weight" not in out:
        out["output.weight"] = out["token_embd.weight"]
    return out


def _split(name: str, value: torch.Tensor, cfg: GPTConfig, arch: str) -> dict[str, torch.Tensor]:
    """One of our fused weights as the pieces llama.cpp keeps apart (gpt2 keeps q|k|v fused, as we do)."""
    if arch != "gpt2" and name == "attn.c_attn":
        q, k, v = value.split(cfg.n_embd)
        if arch in INTERLEAVED_ROPE:
            q, k = _interleave_rotary(q, cfg.n_head), _interleave_rotary(k, cfg.n_head)
        return {"attn.q": q, "attn.k": k, "attn.v": v}
    if arch != "gpt2" and name == "mlp.c_fc":
        if cfg.mlp == "relu2":
            return {"mlp.up": value}
        gate, up = value.chunk(2)
        return {"mlp.gate": gate, "mlp.up": up}
    return {name: value}


def _interleave_rotary(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder each head's rows from pairs (i, i + d/2) turning together to pairs (2i, 2i + 1)."""
    shape = rows.shape
    return rows.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _stored(name: str, value: torch.Tensor, gguf_type: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A tensor's bytes in the type asked for; 1-D tensors and positions stay f32, as llama.cpp's converter keeps
    them, and a q8_0 row that is not a multiple of its 32-value block falls back to f16, as there."""
    import gguf

    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    array = value.numpy()
    if array.ndim == 1 or name.startswith("position_embd"):
        qtype = gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32:
        qtype = gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(model: GPT, tokenizer: Tokenizer, out: Path, gguf_type: str, name: str) -> Path:
    """Write `model` and its tokenizer as one GGUF file at `out` (atomically: beside it, then renamed)."""
    import gguf

    cfg = model.config
    arch = gguf_arch(cfg)
    vocab = gguf_vocab(tokenizer, cfg.vocab_size)
    tensors = gguf_tensors(model, arch)
    _remove_stale_temp_files(out)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")  # as files.atomic_write names it
    try:
        with writing(out):
            writer = gguf.GGUFWriter(tmp, arch)
            _add_hyperparameters(writer, cfg, arch, name)
            _add_vocab(writer, vocab)
            writer.add_file_type(gguf.LlamaFileType[GGUF_FILE_TYPES[gguf_type]])
            if gguf_type == "q8_0":
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for key, value in tensors.items():
                data, qtype = _stored(key, value, gguf_type)
                writer.add_tensor(key, data, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return usual_mode(out)


def _remove_stale_temp_files(out: Path) -> None:
    """Delete what an export to `out` killed mid-write left (its temp file names a process no longer running)."""
    for path in stale_temp_files(out.parent, re.escape(out.name)):
        pid = int(path.name.rsplit(".", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # another user's live process


def _add_hyperparameters(writer: gguf.GGUFWriter, cfg: GPTConfig, arch: str, name: str) -> None:
    writer.add_name(printable(name))  # GGUF strings are UTF-8: a folder name may not be
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(cfg.hidden_size)
    writer.add_head_count(cfg.n_head)
    if arch == "gpt2":
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
        return
    writer.add_head_count_kv(cfg.n_head)
    writer.add_layer_norm_rms_eps(cfg.layer_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.n_embd // cfg.n_head)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "apertus":
        for key, value in RELU2_AS_XIELU.items():
            getattr(writer, f"add_xielu_{key}")([value] * cfg.n_layer)


def _add_vocab(writer: gguf.GGUFWriter, vocab: GGUFVocab) -> None:
    import gguf

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.eot)
    writer.add_eos_token_id(vocab.eot)
    writer.add_add_bos_token(False)
    if vocab.chat_end is not None:
        writer.add_chat_template(vocab.chat_jinja)
        writer.add_eot_token_id(vocab.chat_end)  # an end of generation: llama.cpp stops a reply there
    if vocab.fim is not None:
        writer.add_uint32(gguf.Keys.Tokenizer.FIM_PRE_ID, vocab.fim.prefix)
        writer.add_uint32(gguf.Keys.Tokenizer.FIM_SUF_ID, vocab.fim.suffix)
        writer.add_uint32(gguf.Keys.Tokenizer.FIM_MID_ID, vocab.fim.middle)
