"""What each configuration value may be, and which combinations of values cannot work; every failure is one
line naming the key, the value and what is allowed."""

from __future__ import annotations

import math
import re
from typing import Any

from gptforge.config.sections import PARALLEL, SCHEDULES, Config, TrainConfig
from gptforge.data.mixture import parse_mix
from gptforge.errors import GptforgeError
from gptforge.model.lora import TARGETS as LORA_TARGETS
from gptforge.runtime import DTYPE_NAMES, MAX_THREADS
from gptforge.tasks.score import REWARDS
from gptforge.tokens.chat import TEMPLATES


def _at_least(low: float) -> tuple[Any, str]:
    return (lambda v: v >= low), f">= {low}"


def _within(low: float, high: float, high_ok: bool = False) -> tuple[Any, str]:
    return (lambda v: low <= v <= high if high_ok else low <= v < high), f"in [{low}, {high}{']' if high_ok else ')'}"


def _one_of(*names: str) -> tuple[Any, str]:
    return (lambda v: v in names), f"one of {', '.join(names)}"


_POSITIVE = ((lambda v: v > 0), "> 0")
_LEARNING_RATE = ((lambda v: 0 < v <= 1000), "in (0, 1000]")  # torch fails on 1e38 with a float overflow
# What each checked key allows; every failure is one line naming the key, the value and this.
# Sizes are bounded far past today's largest models (16k wide, 256k tokens), short of tensors too large to exist:
# a hand-edited size is one line here, not an allocation failure later.
RULES: dict[str, tuple[Any, str]] = {
    "model.block_size": _within(1, 2**20, high_ok=True),
    "model.vocab_size": _within(1, 2**24, high_ok=True),
    "model.n_layer": _within(1, 2**14, high_ok=True),
    "model.n_head": _at_least(1),
    "model.n_embd": _within(1, 2**16, high_ok=True),
    "model.vocab_multiple": _at_least(1),
    "model.dropout": _within(0, 1),
    "model.layer_norm_eps": _POSITIVE,
    "model.norm": _one_of("layernorm", "rmsnorm"),
    "model.position": _one_of("learned", "rotary"),
    "model.rope_theta": _at_least(1),  # below 1 every dimension turns faster than a radian a token (tiny: NaN)
    "model.mlp": _one_of("gelu", "swiglu", "relu2"),
    "model.mlp_hidden": _within(0, 2**20, high_ok=True),
    "model.document_token": _within(-1, 2**24),
    "optim.lr": _LEARNING_RATE,
    "optim.min_lr_ratio": _within(0, 1, high_ok=True),
    "optim.warmup_steps": _at_least(0),
    "optim.weight_decay": _at_least(0),
    "optim.beta1": _within(0, 1),
    "optim.beta2": _within(0, 1),
    "optim.eps": _POSITIVE,
    "optim.grad_clip": _at_least(0),
    "optim.schedule": _one_of(*SCHEDULES),
    "optim.decay_fraction": _within(0, 1, high_ok=True),
    "optim.optimizer": _one_of("adamw", "muon"),
    "train.parallel": _one_of(*PARALLEL),
    "optim.muon_lr": _LEARNING_RATE,
    "optim.muon_momentum": _within(0, 1),
    "data.fim_rate": _within(0, 1, high_ok=True),
    "data.fim_spm_rate": _within(0, 1, high_ok=True),
    "data.chat_template": ((lambda v: v in ("", *TEMPLATES)), f"'' (a base model) or {', '.join(TEMPLATES)}"),
    "train.micro_batch": _at_least(1),
    "train.batch_tokens": _within(1, 2**48, high_ok=True),
    "train.seed": ((lambda v: 0 <= v < 2**63), "in [0, 2**63)"),
    "train.max_steps": _within(1, 2**53, high_ok=True),  # steps x tokens stay finite in a float (plan's hours)
    "train.time_budget": _at_least(0),
    "train.device": ((lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v)), "auto, cpu, cuda, cuda:N or mps"),
    "train.dtype": _one_of("auto", *DTYPE_NAMES),
    "train.batch_ramp_tokens": _at_least(0),
    "train.max_skips": _at_least(1),
    # timedelta(seconds=1e300) overflows under torchrun; 11 days is already no timeout for a stalled collective
    "train.dist_timeout": ((lambda v: 0 < v <= 10**6), "in (0, 1000000] seconds"),
    "train.peak_flops": _at_least(0),
    "train.threads": _within(0, MAX_THREADS, high_ok=True),
    "train.lora_rank": _within(0, 2**12, high_ok=True),
    # alpha / rank scales every update: past 2**16 it overflows (1e300: every step non-finite and skipped)
    "train.lora_alpha": ((lambda v: 0 < v <= 2**16), "in (0, 65536]"),
    "train.lora_dropout": _within(0, 1),
    "train.lora_targets": (
        (lambda v: bool(v) and set(v.split(",")) <= set(LORA_TARGETS)),
        f"a comma-separated subset of {','.join(LORA_TARGETS)}",
    ),
    "eval.every": _at_least(0),
    "eval.tokens": _at_least(1),
    "eval.hellaswag_limit": _at_least(0),
    "eval.code": _at_least(0),
    "eval.sample_tokens": _within(0, 2**14, high_ok=True),  # generated at every evaluation: 1e21 never ends
    "checkpoint.every": _at_least(0),
    "checkpoint.keep_last": _at_least(0),
    "checkpoint.milestone_every": _at_least(0),
    "log.every": _at_least(1),
    "rl.tasks_per_step": _within(1, 2**16, high_ok=True),
    "rl.group": _within(2, 2**10, high_ok=True),  # one reply has no group to be better or worse than
    "rl.temperature": ((lambda v: 0 < v <= 100), "in (0, 100]: greedy replies of a group would all agree"),
    "rl.max_new_tokens": _within(1, 2**14, high_ok=True),
    "rl.reward": _one_of(*REWARDS),
    "rl.kl": _at_least(0),
    "rl.updates": _within(1, 64, high_ok=True),
    "rl.clip": ((lambda v: 0 < v < 1), "in (0, 1)"),
    "rl.micro_batch": _at_least(1),
    "rl.eval_tasks": _within(0, 2**16, high_ok=True),
    "rl.eval_samples": _within(1, 2**10, high_ok=True),
    "rl.eval_temperature": _within(0, 100, high_ok=True),
}


def validate(cfg: Config, where: str = "", saved: bool = False) -> Config:
    """Check every value against RULES, then the combinations of keys; the first failure is one line. A `saved`
    config (a checkpoint's) may hold settings that had no effect, which older versions accepted: it still loads."""
    where = f"{where}: " if where else ""
    for dotted, (ok, allowed) in RULES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise GptforgeError(f"{where}{dotted}={value!r} (expected {allowed})")
    problem = _combination_problem(cfg) or (None if saved else _ineffective_setting(cfg))
    if problem:
        raise GptforgeError(f"{where}{problem}")
    return cfg


def _combination_problem(cfg: Config) -> str | None:
    """What is wrong with a combination of keys that each pass RULES, or None."""
    m = cfg.model
    if m.n_embd % m.n_head:
        return f"model.n_head={m.n_head} must divide model.n_embd={m.n_embd} (each head gets n_embd / n_head dims)"
    if m.position == "rotary" and (m.n_embd // m.n_head) % 2:
        return (
            f"model.position=rotary needs an even head size, but model.n_embd={m.n_embd} / model.n_head={m.n_head} "
            f"= {m.n_embd // m.n_head} (rotary turns each head's dimensions in pairs)"
        )
    if cfg.data.mix and cfg.data.path:
        return "data.mix and data.path (--data) are exclusive: a mix lists its folders, data.path is one folder"
    try:
        parse_mix(cfg.data.mix)
    except GptforgeError as e:
        return str(e)
    if cfg.optim.optimizer == "muon" and cfg.train.zero:  # refused with one process too: it would fail under torchrun
        return "optim.optimizer=muon with train.zero=true: ZeRO shards one AdamW's state; drop train.zero"
    if cfg.train.lora_rank and not cfg.train.init_from:
        return "train.lora_rank needs train.init_from: adapters fine-tune a trained model's frozen weights"
    if cfg.train.lora_rank and cfg.train.parallel == "fsdp":
        return "train.lora_rank with train.parallel=fsdp: adapters are trained under ddp (their frozen base is shared)"
    if cfg.train.parallel == "fsdp" and cfg.train.zero:
        return "train.zero=true with train.parallel=fsdp: FSDP already shards the optimizer's state; drop train.zero"
    if cfg.train.parallel == "fsdp" and cfg.optim.optimizer == "muon":
        return (
            "optim.optimizer=muon with train.parallel=fsdp: Muon orthogonalises whole matrices and FSDP shards them "
            "(not supported yet); use optim.optimizer=adamw, or train.parallel=ddp"
        )
    return None


def _ineffective_setting(cfg: Config) -> str | None:
    """A setting the run would silently ignore, or None."""
    if cfg.checkpoint.async_save and cfg.train.parallel != "fsdp":
        return (
            "checkpoint.async_save=true needs train.parallel=fsdp: only sharded checkpoints are written in the "
            "background (drop checkpoint.async_save)"
        )
    return None if cfg.train.lora_rank else _unused_lora_setting(cfg.train)


def _unused_lora_setting(train: TrainConfig) -> str | None:
    """A LoRA setting changed from its default in a run without adapters (it would be silently ignored), or None."""
    default = TrainConfig()
    for key in ("lora_alpha", "lora_dropout", "lora_targets"):
        value = getattr(train, key)
        if value != getattr(default, key):
            said = f"{value:g}" if isinstance(value, float) else value
            return f"train.{key}={said} has no effect without train.lora_rank (0: every weight is trained)"
    return None
