"""Fine-tuning a trained model: on conversations (the chat template's tokens, packed conversations, the loss on the
replies) and with low-rank adapters (LoRA) in place of every weight."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gptforge.config import Config, lora_spec
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.lora import LoRASpec, apply_lora
from gptforge.tokens.chat import TEMPLATE_NAME, chat_template, with_chat
from gptforge.tokens.tokenizer import Tokenizer

NEW_ROWS_SEED = 0x5F7  # the embedding rows a fine-tuning adds (the template's tokens) start the same on every rank


def is_chat_data(manifests: list[dict[str, Any]]) -> bool:
    """The data is conversations (`prepare --chat`): windows of whole conversations, the loss on the replies."""
    return any(m.get("chat") for m in manifests)


def template_name(cfg: Config, manifests: list[dict[str, Any]], init_cfg: Config | None) -> str:
    """The template the run's model speaks: its data's, its own (a resume), or the model it starts from's."""
    if is_chat_data(manifests):
        check_no_fim(cfg, init_cfg)
    inherited = init_cfg.data.chat_template if init_cfg is not None else ""
    return TEMPLATE_NAME if is_chat_data(manifests) or cfg.data.chat_template or inherited else ""


def check_no_fim(cfg: Config, init_cfg: Config | None) -> None:
    """Refuse FIM with conversations: a chat folder holds the template's tokens at the two ids past the base
    vocabulary, which are FIM's first sentinels to a model that has them (the loader would not rearrange them)."""
    if cfg.data.fim_rate > 0:
        raise GptforgeError(
            f"data.fim_rate={cfg.data.fim_rate:g}: conversations (prepare --chat) are not trained with "
            "fill-in-the-middle (their template's ids would read as FIM's sentinels); set data.fim_rate=0"
        )
    if init_cfg is not None and init_cfg.data.fim_rate > 0:
        raise GptforgeError(
            f"train.init_from={cfg.train.init_from}: trained with data.fim_rate={init_cfg.data.fim_rate:g}; a FIM "
            "model is not fine-tuned on conversations (its sentinels hold the ids the template's tokens take in "
            "the data): fine-tune a base trained without FIM"
        )


def check_fim(cfg: Config, init_cfg: Config | None, template: str) -> None:
    """Refuse a chat model and FIM changing between the base and the run: both append tokens past the vocabulary,
    so one's ids would become the other's."""
    if init_cfg is None or not template or (init_cfg.data.fim_rate > 0) == (cfg.data.fim_rate > 0):
        return
    raise GptforgeError(
        f"train.init_from={cfg.train.init_from}: trained with data.fim_rate={init_cfg.data.fim_rate:g}, this run "
        f"with {cfg.data.fim_rate:g}; with the chat template both would take the ids past the vocabulary (not "
        "supported): keep data.fim_rate as the base had it"
    )


def chat_tokenizer(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return with_chat(tokenizer) if template and chat_template(tokenizer) is None else tokenizer


def packed_model(model_cfg: GPTConfig, manifests: list[dict[str, Any]], eot: int) -> GPTConfig:
    """A model trained on conversations reads each packed conversation alone (model.document_token = EOT)."""
    return dataclasses.replace(model_cfg, document_token=eot) if is_chat_data(manifests) else model_cfg


def fit_vocabulary(weights: dict[str, torch.Tensor], model_cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """`weights` with the token tables grown to the model's padded vocabulary: tokens a fine-tuning adds past the
    padding (a trained BPE's template tokens) get fresh rows initialised as GPT-2 initialises embeddings."""
    rows = model_cfg.padded_vocab_size
    out = dict(weights)
    generator = torch.Generator().manual_seed(NEW_ROWS_SEED)
    grown: dict[int, torch.Tensor] = {}
    for key in ("transformer.wte.weight", "lm_head.weight"):
        table = weights.get(key)
        if table is None or table.size(0) == rows:
            continue
        if table.size(0) > rows:
            raise GptforgeError(f"train.init_from: its {key} has {table.size(0):,} rows, more than {rows:,}")
        if id(table) not in grown:  # a tied table grows once, and stays one tensor
            fresh = torch.empty(rows - table.size(0), table.size(1)).normal_(0.0, 0.02, generator=generator)
            grown[id(table)] = torch.cat([table, fresh.to(table.dtype)])
        out[key] = grown[id(table)]
    return out


def adapt(model: GPT, cfg: Config) -> str | None:
    """Put LoRA adapters on train.lora_targets, every base weight frozen; the header's line about them."""
    spec = lora_spec(cfg.train)
    if spec is None:
        return None
    check_rank(model, spec)
    names = apply_lora(model, spec)  # train.lora_targets names layers every GPT has (checked at load)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = model.num_params()  # as the header counts them: the real vocabulary's rows, the adapters included
    return (
        f"LoRA: rank {spec.rank} (alpha {spec.alpha:g}) on {len(names)} layers; {trainable:,} trainable parameters "
        f"of {total:,} ({trainable / total:.2%}), the rest frozen"
    )


def check_rank(model: GPT, spec: LoRASpec) -> None:
    """Refuse a rank past a targeted layer's min(in, out): B A is already full rank there, so the rank adds
    trainable parameters (more than the layer's own at 2x) and no capacity."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(spec.targets)]
    name, narrowest = min(layers, key=lambda item: min(item[1].in_features, item[1].out_features))
    width = min(narrowest.in_features, narrowest.out_features)
    if spec.rank > width:
        raise GptforgeError(
            f"train.lora_rank={spec.rank}: past the width of {name} ({narrowest.in_features} -> "
            f"{narrowest.out_features}), where a rank of {width} is already a full-rank update; use at most {width}"
        )
