"""Run configuration: nested dataclasses; defaults < TOML preset < `--set section.key=value` overrides.

Unknown sections/keys and wrong types are errors. Each field's docstring is its documentation
(`gptforge train --help-config` prints them). `model.preset = "gpt2-medium"` (gpt2, gpt2-medium, gpt2-large,
gpt2-xl) sets n_layer/n_head/n_embd at that point of the precedence order.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import json
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gptforge.data.mixture import parse_mix
from gptforge.errors import GptforgeError
from gptforge.files import read_text
from gptforge.model.gpt import MODEL_PRESETS, GPTConfig
from gptforge.runtime import DTYPE_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


@dataclass
class DataConfig:
    path: str = ""
    """Folder written by `gptforge prepare` (manifest.json + shards); `--data` sets it."""
    mix: list[str] = field(default_factory=list)
    """Instead of `path`: several prepared folders trained on at once, as FOLDER=WEIGHT entries (TOML: a list of
    strings; --set: comma-separated). Each folder's share of the training windows is its weight over their sum,
    in every stretch of training; its val split is scored on its own (val `loss/NAME`, `bpb/NAME`)."""
    shuffle: bool = True
    """Serve training windows in a seeded random order each epoch (else in corpus order)."""
    fim_rate: float = 0.0
    """Fill-in-the-middle: the share of training documents rearranged as prefix/suffix/middle with sentinel tokens
    as batches are read (StarCoder: 0.5), so the model learns to infill (`sample --suffix`). Validation stays
    left to right."""
    fim_spm_rate: float = 0.5
    """Of the rearranged documents, the share in suffix-prefix-middle order (the rest prefix-suffix-middle)."""


SCHEDULES = ("cosine", "wsd", "constant")  # optim.lr_at computes each


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate, reached at the end of warm-up."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio (GPT-3: 10%)."""
    warmup_steps: int = 715
    """Linear warm-up steps from lr/warmup_steps to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices and embeddings only (not biases or LayerNorm gains)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2 (GPT-3: 0.95)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables); the pre-clip norm is logged."""
    schedule: str = "cosine"
    """cosine (warm-up, cosine decay to min), wsd (warm-up, stable, linear decay to min), or constant."""
    decay_fraction: float = 0.2
    """For wsd: the share of the steps spent decaying at the end."""
    optimizer: str = "adamw"
    """adamw (GPT-3), or muon: Muon for the blocks' 2-D matrices, AdamW (lr, betas, eps above) for embeddings,
    lm_head, gains and biases."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the schedule scales it with lr)."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""


@dataclass
class TrainConfig:
    micro_batch: int = 64
    """Sequences per forward/backward pass per process (B)."""
    batch_tokens: int = 524_288
    """Tokens per optimizer step across all processes; gradient accumulation makes up the difference."""
    max_steps: int = 19_073
    """Optimizer steps; the LR schedule spans exactly these."""
    time_budget: float = 0.0
    """Wall-clock seconds for the whole run (0: none): the step count is planned from the steps' pace, and again
    as it drifts, so that the schedule ends on time; a resumed run counts its earlier commands' seconds."""
    seed: int = 1337
    """Seed for initialization and data order."""
    device: str = "auto"
    """auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16: autocast dtype; auto = bf16 on GPUs and on CPUs where it measures faster."""
    compile: bool = False
    """torch.compile the model for training (evaluation and sampling keep working)."""
    zero: bool = False
    """Shard AdamW's state across processes (ZeroRedundancyOptimizer) for models whose optimizer does not fit."""
    dist_timeout: float = 300.0
    """Seconds a rank waits for the others in a collective before the run fails (PyTorch waits 1800): 5 minutes
    covers the others waiting while rank 0 writes a checkpoint; raise it if `checkpoint.push` takes longer."""
    batch_ramp_tokens: int = 0
    """GPT-3's batch ramp: grow the batch linearly from one micro-batch per process to batch_tokens over this
    many tokens (0: full batch from the start)."""
    max_skips: int = 10
    """Stop after this many steps in a row with a non-finite loss or gradient (each is skipped, not applied)."""
    threads: int = 0
    """CPU threads per process (0: torch's count, one per core). On busy cores fewer can be faster: a run whose
    threads barely outrun one thread at matmuls, or measure far below an idle core's speed, says so."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU (0: from the GPU table, or a matmul probe on CPU)."""
    init_from: str = ""
    """Checkpoint whose weights start the run (e.g. from `gptforge import`); its model section replaces ours."""


@dataclass
class EvalConfig:
    every: int = 250
    """Validate every N steps (and at the first and last step); 0: only at the start and the end."""
    tokens: int = 1_048_576
    """Validation tokens per evaluation: whole batches of windows spread evenly over the split (capped by its size)."""
    hellaswag: str = ""
    """HellaSwag jsonl[.gz] (or hf:Rowan/hellaswag) scored at every evaluation (empty: none)."""
    hellaswag_limit: int = 0
    """HellaSwag examples per evaluation (0: all 10,042)."""
    code: int = 0
    """Code measures at every evaluation on the validation split (0: none): N hidden lines and N hidden 3-line
    spans written back (with the suffix for a FIM model, and from the prefix alone), and up to N sampled function
    bodies parsed; the first process scores them."""
    prompt: str = "def fibonacci(n):"
    """Prompt for the text sample printed at each evaluation."""
    sample_tokens: int = 64
    """Tokens to generate for that sample (0: no samples)."""


@dataclass
class CheckpointConfig:
    every: int = 5000
    """Save a checkpoint every N steps (0: only at the end); the last step always saves."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    milestone_every: int = 0
    """Never delete checkpoints whose step is a multiple of this (0: no milestones)."""
    push: str = ""
    """Git repository (e.g. a Hugging Face model repo) that gets each checkpoint, exported, as a commit."""
    push_branch: str = ""
    """Branch for `push` (default: the run folder's name): one branch per run."""


@dataclass
class LogConfig:
    every: int = 1
    """Print a console line every N steps (every step is written to metrics.jsonl)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (needs `pip install tensorboard`)."""
    wandb: str = ""
    """Also log to this W&B project (WANDB_MODE=offline works without a network; needs `pip install wandb`)."""


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _coerce(value: Any, typ: type, where: str, parse: bool) -> Any:
    """Parse a `--set` string (parse=True) or check a TOML/JSON value against a field's type."""
    if typing.get_origin(typ) is list:  # of strings; comma-separated after --set
        items = [item.strip() for item in value.split(",") if item.strip()] if parse else value
        if not (isinstance(items, list) and all(isinstance(item, str) for item in items)):
            raise GptforgeError(f"{where}: expected a list of strings, got {type(value).__name__} {value!r}")
        return list(items)
    if parse and typ is not str:
        text = value.strip().lower()
        try:
            if typ is bool:
                if text not in ("true", "false", "1", "0"):
                    raise ValueError
                return text in ("true", "1")
            return typ(value)
        except ValueError:
            raise GptforgeError(f"{where}: expected {typ.__name__}, got {value!r}") from None
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise GptforgeError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _section_types(section: Any) -> dict[str, type]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


# Keys that moved to the section that uses them; the old spelling still works (presets, --set, old checkpoints).
MOVED = {"train.fused_loss": "model.fused_loss", "train.activation_checkpointing": "model.activation_checkpointing"}


def _set(cfg: Config, dotted: str, value: Any, where: str, parse: bool = False) -> None:
    dotted = MOVED.get(dotted, dotted)
    if dotted == "model.preset":  # a shorthand for GPT-2's shapes, expanded where it appears
        if value not in MODEL_PRESETS:
            raise GptforgeError(f"{where}: model.preset={value!r} (expected one of {sorted(MODEL_PRESETS)})")
        for key, size in MODEL_PRESETS[value].items():
            setattr(cfg.model, key, size)
        return
    section_name, _, key = dotted.partition(".")
    section = getattr(cfg, section_name, None) if section_name in _section_types(cfg) else None
    if section is None:
        sections = list(_section_types(cfg))
        raise GptforgeError(f"{where}: unknown config section {section_name!r} (expected one of {sections})")
    types = _section_types(section)
    if key not in types:
        raise GptforgeError(f"{where}: unknown key {dotted!r} (expected one of {sorted(types)})")
    setattr(section, key, _coerce(value, types[key], f"{where}: {dotted}", parse))


def _at_least(low: float) -> tuple[Any, str]:
    return (lambda v: v >= low), f">= {low}"


def _within(low: float, high: float, high_ok: bool = False) -> tuple[Any, str]:
    return (lambda v: low <= v <= high if high_ok else low <= v < high), f"in [{low}, {high}{']' if high_ok else ')'}"


def _one_of(*names: str) -> tuple[Any, str]:
    return (lambda v: v in names), f"one of {', '.join(names)}"


_POSITIVE = ((lambda v: v > 0), "> 0")
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
    "optim.lr": _POSITIVE,
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
    "optim.muon_lr": _POSITIVE,
    "optim.muon_momentum": _within(0, 1),
    "data.fim_rate": _within(0, 1, high_ok=True),
    "data.fim_spm_rate": _within(0, 1, high_ok=True),
    "train.micro_batch": _at_least(1),
    "train.batch_tokens": _at_least(1),
    "train.seed": ((lambda v: 0 <= v < 2**63), "in [0, 2**63)"),
    "train.max_steps": _at_least(1),
    "train.time_budget": _at_least(0),
    "train.device": ((lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v)), "auto, cpu, cuda, cuda:N or mps"),
    "train.dtype": _one_of("auto", *DTYPE_NAMES),
    "train.batch_ramp_tokens": _at_least(0),
    "train.max_skips": _at_least(1),
    "train.dist_timeout": _POSITIVE,
    "train.peak_flops": _at_least(0),
    "train.threads": _at_least(0),
    "eval.every": _at_least(0),
    "eval.tokens": _at_least(1),
    "eval.hellaswag_limit": _at_least(0),
    "eval.code": _at_least(0),
    "eval.sample_tokens": _at_least(0),
    "checkpoint.every": _at_least(0),
    "checkpoint.keep_last": _at_least(0),
    "checkpoint.milestone_every": _at_least(0),
    "log.every": _at_least(1),
}


def validate(cfg: Config, where: str = "") -> Config:
    """Check every value against RULES, then the combinations of keys; the first failure is one line."""
    where = f"{where}: " if where else ""
    for dotted, (ok, allowed) in RULES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise GptforgeError(f"{where}{dotted}={value!r} (expected {allowed})")
    problem = _combination_problem(cfg)
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
    return None


def preset_path(name: str, flag: str = "--config") -> Path:
    """A preset name (`configs/NAME.toml` shipped with the package) or a path to a TOML file; errors name `flag`."""
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise GptforgeError(f"{flag} {name}: no such file")
        return path
    shipped = resources.files("gptforge") / "configs" / f"{name}.toml"
    if not shipped.is_file():
        raise GptforgeError(f"{flag} {name}: unknown preset (expected one of {preset_names()} or a .toml file)")
    return Path(str(shipped))


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in (resources.files("gptforge") / "configs").iterdir() if p.name.endswith(".toml"))


def load_config(preset: str | None = None, overrides: list[str] = (), base: Config | None = None) -> Config:
    """Defaults (or `base`), then the preset's TOML, then `section.key=value` overrides."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    if preset:
        path = preset_path(preset)
        try:
            data = tomllib.loads(read_text(path))
        except tomllib.TOMLDecodeError as e:
            raise GptforgeError(f"{path}: invalid TOML ({e})") from None
        for section_name, values in data.items():
            if not isinstance(values, dict):
                raise GptforgeError(f"{path}: top-level key {section_name!r} must be a [section]")
            for key, value in values.items():
                _set(cfg, f"{section_name}.{key}", value, str(path))
    for item in overrides:
        dotted, eq, value = item.partition("=")
        if not eq:
            raise GptforgeError(f"--set {item}: expected section.key=value")
        _set(cfg, dotted.strip(), value, f"--set {item}", parse=True)
    return validate(cfg)


def config_from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config saved with `to_dict` (checkpoints), validating as a preset would be."""
    cfg = Config()
    for section_name, values in data.items():
        for key, value in values.items():
            _set(cfg, f"{section_name}.{key}", value, "checkpoint config")
    return validate(cfg, "checkpoint config")


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (sections of scalars; strings JSON-escaped, which TOML accepts)."""
    lines = []
    for section_name, values in to_dict(cfg).items():
        lines.append(f"[{section_name}]")
        for key, value in values.items():
            text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)


def describe() -> str:
    """Every option with its default and docstring, for `--help-config`."""
    out = []
    for section_name, section in vars(Config()).items():
        docs = _field_docs(type(section))
        for f in dataclasses.fields(section):
            out.append(f"  {section_name}.{f.name} = {getattr(section, f.name)!r}\n      {docs.get(f.name, '')}")
    return "\n".join(out)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after each annotated field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs
