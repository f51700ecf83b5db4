"""Reading a folder someone else wrote (a Hugging Face model): only files inside it, JSON of the expected shape,
and each config.json value checked as `config.RULES` checks our own before anything is sized from it.

Every refusal is one line naming the file, the key, the value and what was expected.
"""

from __future__ import annotations

import json
import math
import pickle
import typing
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gptforge.config import RULES
from gptforge.errors import GptforgeError, first_detail
from gptforge.inputs import read_text, utf8_path
from gptforge.model.gpt import GPTConfig
from gptforge.runtime.device import DTYPES

FLOAT_DTYPES = {dtype: name for name, dtype in DTYPES.items()}
# Buffers older HF checkpoints saved, which the model derives: GPT-2's causal masks, Llama's rotary frequencies.
DERIVED = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
INDEX = "model.safetensors.index.json"
FIELD_TYPES = typing.get_type_hints(GPTConfig)


def shown(value: Any) -> str:
    """A value as its JSON file spells it, cut short: a hand-edited value can be a list of a million items."""
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _root(hf_dir: Path) -> Path:
    """What the folder may read: itself, or for a snapshot in Hugging Face's cache, its repo's folder, whose
    blobs/ its files link to."""
    root = hf_dir.resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return root.parent.parent
    return root


def folder_file(hf_dir: Path, name: Any, named_in: str = "") -> Path:
    """`hf_dir / name`, refused if it leads outside the folder (`..`, an absolute path, a link); `named_in`
    says where a name read from a file came from ('FILE: weight_map entry X')."""
    if named_in and (not isinstance(name, str) or not name or "\0" in name):
        raise GptforgeError(f"{named_in} is {shown(name)} (expected a file name inside {hf_dir})")
    root, path = _root(hf_dir), hf_dir / name
    what = f"{named_in} names {shown(name)}, which" if named_in else f"{path}:"
    try:
        resolved = path.resolve()
        path.is_file()  # a name too long fails here, where it can be named
    except (OSError, RuntimeError) as e:  # RuntimeError: a loop of links, before Python 3.13
        raise GptforgeError(f"{what} cannot be opened ({getattr(e, 'strerror', None) or 'a loop of links'})") from None
    if resolved != root and root not in resolved.parents:
        how = "leads" if named_in else f"a link to {resolved},"
        raise GptforgeError(f"{what} {how} outside {root} (an import reads only the files inside its folder)")
    return path


def read_json(path: Path, kind: type, expected: str) -> Any:
    """A JSON file whose top level is a `kind` (dict or list); anything else is one line saying `expected`."""
    try:
        data = json.loads(read_text(path))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of too many digits, deep nesting
        raise GptforgeError(f"{path}: not JSON ({type(e).__name__}: {str(e).split(';')[0][:120]})") from None
    if not isinstance(data, kind):
        raise GptforgeError(f"{path}: a JSON {type(data).__name__} (expected {expected})")
    return data


def model_field(where: Path, key: str, value: Any, field: str) -> Any:
    """config.json's `key` as our GPTConfig `field`: its type (a bool is no number, 32.5 no integer), then its rule."""
    integer = FIELD_TYPES[field] is int
    if not integer and type(value) is int and value.bit_length() < 1000:
        value = float(value)  # JSON spells 1.0 as 1; an integer past float's range stays one, refused below
    ok = type(value) is int and value >= 1 if integer else type(value) is float and math.isfinite(value) and value > 0
    positive, kind = ("a positive integer", "an integer") if integer else ("a positive number", "a number")
    if not ok:
        raise GptforgeError(f"{where}: {key}={shown(value)} (expected {positive})")
    rule, allowed = RULES.get(f"model.{field}", (lambda v: True, ""))
    if not rule(value):
        raise GptforgeError(f"{where}: {key}={shown(value)} (expected {kind} {allowed})")
    return value


def model_fields(config: dict[str, Any], fields: dict[str, str], where: Path) -> dict[str, Any]:
    """GPTConfig fields from config.json (defaults merged in): `fields` maps its keys to ours."""
    out = {}
    for key, field in fields.items():
        if key not in config:
            raise GptforgeError(f"{where}: no {key} (expected a positive integer)")
        out[field] = model_field(where, key, config[key], field)
    return out


def check_supported(checks: dict[str, tuple[Any, tuple[Any, ...]]], where: Path) -> None:
    """Each key's value must be one of its allowed values, of the same JSON type (`1` is not `true`)."""
    for key, (value, allowed) in checks.items():
        if not any(type(value) is type(a) and value == a for a in allowed):
            expected = " or ".join(map(shown, allowed))
            raise GptforgeError(f"{where}: {key}={shown(value)} is not supported (expected {expected})")


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, the shards a model.safetensors.index.json names, or pytorch_model.bin (loaded with
    weights_only): floating-point tensors only, since an import computes with the values it reads, uncast."""
    single, index, pickled = (folder_file(hf_dir, n) for n in ("model.safetensors", INDEX, "pytorch_model.bin"))
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = _shards(hf_dir, index)
    elif pickled.is_file():
        files = [pickled]
    else:
        raise GptforgeError(f"{hf_dir}: no model.safetensors, {INDEX} or pytorch_model.bin")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for key, value in _tensors(path).items():
            if key.endswith(DERIVED):
                continue
            if value.dtype not in FLOAT_DTYPES:
                raise GptforgeError(
                    f"{path}: {key} is {str(value.dtype).removeprefix('torch.')} (expected float32, bfloat16 or "
                    "float16 weights: an import neither casts nor dequantizes)"
                )
            if key in weights:
                raise GptforgeError(f"{path}: {key} is in another shard too (expected each tensor once)")
            weights[key] = value
    return weights


def _shards(hf_dir: Path, index: Path) -> list[Path]:
    """The files an index's weight_map names, each inside the folder."""
    weight_map = read_json(index, dict, "an object with a weight_map").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise GptforgeError(f"{index}: weight_map={shown(weight_map)} (expected an object of tensor: file name)")
    shards = {}
    for tensor, name in weight_map.items():
        path = folder_file(hf_dir, name, f"{index}: weight_map entry {shown(tensor)}")
        if not path.is_file():
            raise GptforgeError(f"{index}: weight_map entry {shown(tensor)} names {shown(name)}, which is not a file")
        shards[path] = None
    return list(shards)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file or a pickled state dict; a damaged or foreign file is one line."""
    try:
        if path.suffix == ".bin":
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with utf8_path(path) as name:  # safetensors opens UTF-8 paths only
                state = load_file(name)
    except pickle.UnpicklingError:  # torch's text suggests loading untrusted pickles: not advice to pass on
        raise GptforgeError(f"{path}: unreadable weights (not a PyTorch weights file)") from None
    except Exception as e:  # noqa: BLE001 - safetensors and torch.load raise their own types for a damaged file
        raise GptforgeError(f"{path}: unreadable weights ({type(e).__name__}: {first_detail(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise GptforgeError(f"{path}: not a state dict (expected tensor names and tensors)")
    return state
