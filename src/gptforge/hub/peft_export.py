"""A LoRA run as a PEFT adapter folder: `peft` loads it onto the base model exported beside it.

    OUT/adapter_config.json, adapter_model.safetensors, tokenizer files    the adapters, in PEFT's names and shapes
    OUT/base/                                                              the frozen base weights, an HF model folder

The base is exported with the run's own tokenizer, so tokens the fine-tuning added (the chat template's) exist in it.
The modern block's fused layers are several in Hugging Face (q|k|v, gate|up): an adapter on one is one adapter per
piece, all sharing A, each with its block of B's rows, since B A x stacks the pieces' updates as W x stacks theirs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gptforge.errors import GptforgeError
from gptforge.files import building_dir, named, usual_mode, write_json
from gptforge.hub import modern
from gptforge.hub.convert import export_hf, write_tokenizer_files
from gptforge.model.gpt import GPT
from gptforge.model.lora import LoRASpec, lora_layers, merge_lora
from gptforge.tokens.tokenizer import Tokenizer

BASE = "base"


def hf_adapters(model: GPT) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapter as (A (r, in), B (out, r)) under the name of the HF layer it adapts."""
    gpt2, out = modern.exports_as_gpt2(model.config), {}
    for name, layer in lora_layers(model).items():
        names = (name,) if gpt2 else modern.hf_modules(name, model.config)
        for hf_name, b in zip(names, layer.lora_B.chunk(len(names)), strict=True):
            out[hf_name] = (layer.lora_A, b)
    return out


def adapter_state(model: GPT) -> dict[str, torch.Tensor]:
    """Each adapter under PEFT's key: base_model.model.<layer>.lora_A.weight (r, in) and lora_B.weight (out, r)."""
    out = {}
    for name, pair in hf_adapters(model).items():
        for part, value in zip(("lora_A", "lora_B"), pair, strict=True):
            # a copy each: the pieces of one adapter share its A and B's storage, which safetensors refuses
            out[f"base_model.model.{name}.{part}.weight"] = value.detach().float().cpu().contiguous().clone()
    return out


def adapter_config(model: GPT, spec: LoRASpec, base: Path) -> dict[str, Any]:
    """adapter_config.json: PEFT's scaling is lora_alpha / r, as ours; a target matches a name ending in it."""
    # transformer.h.N.attn.c_attn and model.layers.N.self_attn.q_proj: the layer's name past its index
    targets = list(dict.fromkeys(name.split(".", 3)[3] for name in hf_adapters(model)))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets,
        "fan_in_fan_out": modern.exports_as_gpt2(model.config),  # GPT-2's Conv1D layers store (in, out)
        "bias": "none",
        # where the base is, as a path: a bare "base" is a Hub repo to AutoPeftModel run from another folder
        "base_model_name_or_path": str(base),
    }


def export_peft(model: GPT, tokenizer: Tokenizer, spec: LoRASpec, out_dir: str | Path) -> Path:
    """Write the adapter folder and its base (the model without its adapters)."""
    if not lora_layers(model):
        raise GptforgeError("--format peft: this checkpoint has no adapters (train.lora_rank was 0)")
    out = Path(out_dir)
    final = named(out)  # where the folder will be: a link at `out` is replaced, a link above it is followed
    with building_dir(out) as tmp:
        export_hf(merge_lora(copy.deepcopy(model), merge=False), tokenizer, tmp / BASE)
        write_json(tmp / "adapter_config.json", adapter_config(model, spec, final.parent.resolve() / final.name / BASE))
        save_file(adapter_state(model), tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        usual_mode(tmp / "adapter_model.safetensors")
        write_tokenizer_files(tokenizer, tmp, model.config.block_size)
    return out
