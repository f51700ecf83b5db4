"""A LoRA run as a PEFT adapter folder: `peft` loads it onto the base model exported beside it.

    OUT/adapter_config.json, adapter_model.safetensors, tokenizer files    the adapters, in PEFT's names and shapes
    OUT/base/                                                                 the frozen base weights, a GPT2LMHeadModel

The base is exported with the run's own tokenizer, so tokens the fine-tuning added (the chat template's) exist in it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import save_file

from gptforge.data.tokenizer import Tokenizer
from gptforge.errors import GptforgeError
from gptforge.files import building_dir, usual_mode, write_json
from gptforge.hub import modern
from gptforge.hub.convert import export_hf, write_tokenizer_files
from gptforge.model.gpt import GPT
from gptforge.model.lora import LoRASpec, lora_layers, merge_lora

BASE = "base"


def adapter_state(model: GPT) -> dict[str, torch.Tensor]:
    """Each adapter under PEFT's key: base_model.model.<layer>.lora_A.weight (r, in) and lora_B.weight (out, r)."""
    out = {}
    for name, layer in lora_layers(model).items():
        for part in ("lora_A", "lora_B"):
            out[f"base_model.model.{name}.{part}.weight"] = getattr(layer, part).detach().float().cpu().contiguous()
    return out


def export_peft(model: GPT, tokenizer: Tokenizer, spec: LoRASpec, out_dir: str | Path) -> Path:
    """Write the adapter folder and its base; refused for the modern block, whose fused qkv PEFT sees split."""
    if not modern.exports_as_gpt2(model.config):
        raise GptforgeError(
            "--format peft: only the GPT-2 block exports as an adapter (the modern block's fused qkv becomes three "
            "layers in Hugging Face); export the run as a merged model instead (the default --format hf)"
        )
    if not lora_layers(model):
        raise GptforgeError("--format peft: this checkpoint has no adapters (train.lora_rank was 0)")
    out = Path(out_dir)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.targets),  # PEFT matches a name ending in ".<target>"
        "fan_in_fan_out": True,  # GPT2LMHeadModel's Conv1D layers store (in, out)
        "bias": "none",
        "base_model_name_or_path": BASE,
    }
    with building_dir(out) as tmp:
        export_hf(merge_lora(copy.deepcopy(model), merge=False), tokenizer, tmp / BASE)
        write_json(tmp / "adapter_config.json", config)
        save_file(adapter_state(model), tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        usual_mode(tmp / "adapter_model.safetensors")
        write_tokenizer_files(tokenizer, tmp, model.config.block_size)
    return out
