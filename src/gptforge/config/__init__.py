"""Run configuration: nested dataclasses (`sections`); defaults < TOML preset < `--set section.key=value` overrides,
each value then checked (`rules`).

Unknown sections/keys and wrong types are errors. Each field's docstring is its documentation
(`gptforge train --help-config` prints them). `model.preset = "gpt2-medium"` (gpt2, gpt2-medium, gpt2-large,
gpt2-xl) sets n_layer/n_head/n_embd at that point of the precedence order.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import json
import sys
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from gptforge.config.rules import RULES, validate
from gptforge.config.sections import (
    SCHEDULES,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LogConfig,
    OptimConfig,
    RLConfig,
    TrainConfig,
)
from gptforge.errors import GptforgeError
from gptforge.inputs import printable, read_text
from gptforge.model.gpt import MODEL_PRESETS, GPTConfig
from gptforge.model.lora import LoRASpec

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


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
    return _field_types(type(section))


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    """A dataclass's field types, resolved once: resolving them is most of a checkpoint's check (serve checks
    each request's)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


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


def preset_path(name: str, flag: str = "--config") -> Path:
    """A preset name (`configs/NAME.toml` shipped with the package) or a path to a TOML file; errors name `flag`."""
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            what = "not a regular file (expected a .toml file)" if path.exists() else "no such file"
            raise GptforgeError(f"{flag} {name}: {what}")
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
    return validate(cfg, "checkpoint config", saved=True)


def lora_spec(train: TrainConfig) -> LoRASpec | None:
    """The adapters train.lora_* describe, or None for a run that trains every weight."""
    if not train.lora_rank:
        return None
    targets = tuple(train.lora_targets.split(","))
    return LoRASpec(rank=train.lora_rank, alpha=train.lora_alpha, dropout=train.lora_dropout, targets=targets)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (sections of scalars; strings JSON-escaped, which TOML accepts)."""
    lines = []
    for section_name, values in to_dict(cfg).items():
        lines.append(f"[{section_name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    # TOML holds Unicode only: a path's bytes that are not UTF-8 (lone surrogates) are written as '\\xe9'.
    if isinstance(value, str):
        value = printable(value)
    elif isinstance(value, list):
        value = [printable(v) if isinstance(v, str) else v for v in value]
    return json.dumps(value)


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


__all__ = [
    "RULES",
    "SCHEDULES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "GPTConfig",
    "LogConfig",
    "OptimConfig",
    "RLConfig",
    "TrainConfig",
    "config_from_dict",
    "describe",
    "load_config",
    "lora_spec",
    "preset_names",
    "preset_path",
    "to_dict",
    "to_toml",
    "validate",
]
