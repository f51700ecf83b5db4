import sys

import pytest
import torch

from gptforge.config import config_from_dict, describe, load_config, preset_names, to_dict, to_toml
from gptforge.errors import GptforgeError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def test_precedence_defaults_preset_overrides():
    cfg = load_config("tiny", ["optim.lr=0.5", "train.compile=true", "eval.prompt=x = 1"])
    assert cfg.model.n_layer == 2  # preset
    assert cfg.optim.beta2 == 0.95  # default
    assert cfg.optim.lr == 0.5 and cfg.train.compile is True and cfg.eval.prompt == "x = 1"  # overrides


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lrr=1", "unknown key 'optim.lrr'"),
        ("nope.lr=1", "unknown config section 'nope'"),
        ("train.max_steps=ten", "train.max_steps: expected int, got 'ten'"),
        ("train.compile=maybe", "train.compile: expected bool"),
        ("optim.lr", "expected section.key=value"),
        ("optim.lr=1e38", r"optim.lr=1e\+38 \(expected in \(0, 1000\]\)"),  # torch's float overflow: a traceback
        ("optim.muon_lr=1e300", r"optim.muon_lr=1e\+300 \(expected in \(0, 1000\]\)"),
        ("train.threads=100000", r"train.threads=100000 \(expected in \[0, 1024\]\)"),  # a segfault; 1e12 a traceback
        ("eval.sample_tokens=1000000000", r"eval.sample_tokens=1000000000 \(expected in \[0, 16384\]\)"),  # a hang
        ("train.dist_timeout=1e300", r"train.dist_timeout=1e\+300 \(expected in \(0, 1000000\] seconds"),  # timedelta
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(GptforgeError, match=message):
        load_config("tiny", [override])


def test_bad_preset_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmax_steps = 'ten'\n")
    with pytest.raises(GptforgeError, match=r"bad\.toml: train\.max_steps: expected int, got str"):
        load_config(str(bad))
    bad.write_text("[optim]\nlearning_rate = 1\n")
    with pytest.raises(GptforgeError, match="unknown key 'optim.learning_rate'"):
        load_config(str(bad))
    with pytest.raises(GptforgeError, match="unknown preset"):
        load_config("no-such-preset")
    with pytest.raises(GptforgeError, match=r"--config /dev/null: not a regular file \(expected a \.toml file\)"):
        load_config("/dev/null")  # it exists: "no such file" said otherwise
    with pytest.raises(GptforgeError, match=r"--config missing\.toml: no such file"):
        load_config("missing.toml")


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_round_trips(name, tmp_path):
    cfg = load_config(name)
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert tomllib.loads(path.read_text())["model"]["n_layer"] == cfg.model.n_layer
    assert load_config(str(path)) == cfg


def test_every_option_is_documented():
    for line in describe().splitlines()[1::2]:
        assert line.strip(), "an option without a docstring"


def test_model_preset_expands_in_precedence_order():
    cfg = load_config("tiny", ["model.preset=gpt2-medium"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (24, 16, 1024)
    cfg = load_config("tiny", ["model.preset=gpt2-xl", "model.n_layer=2"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (2, 25, 1600)
    with pytest.raises(GptforgeError, match="model.preset='gpt5'"):
        load_config("tiny", ["model.preset=gpt5"])


def test_moved_keys_keep_their_old_spelling():
    """fused_loss and activation_checkpointing moved from [train] to [model]; presets, --set and old checkpoints
    that say train.* still work."""
    from gptforge.config import config_from_dict

    cfg = load_config("tiny", ["train.fused_loss=false", "train.activation_checkpointing=true"])
    assert cfg.model.fused_loss is False and cfg.model.activation_checkpointing is True
    old = {"model": {"n_layer": 3}, "train": {"fused_loss": False, "micro_batch": 2}}
    restored = config_from_dict(old)
    assert (restored.model.n_layer, restored.model.fused_loss, restored.train.micro_batch) == (3, False, 2)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.n_head=3", "model.n_head=3 must divide model.n_embd=32"),
        ("model.dropout=2", r"model.dropout=2.0 \(expected in \[0, 1\)\)"),
        ("optim.beta1=1.5", r"optim.beta1=1.5 \(expected in \[0, 1\)\)"),
        ("optim.lr=-1", r"optim.lr=-1.0 \(expected in \(0, 1000\]\)"),
        ("optim.lr=nan", r"optim.lr=nan \(expected in \(0, 1000\]\)"),
        ("optim.schedule=linear", "optim.schedule='linear' \\(expected one of cosine, wsd, constant\\)"),
        ("train.batch_tokens=0", r"train.batch_tokens=0 \(expected in \[1, 281474976710656\]\)"),
        ("train.max_steps=9007199254740993", r"train.max_steps=9007199254740993 \(expected in \[1, 9007\d+\]\)"),
        ("train.device=tpu", "train.device='tpu' \\(expected auto, cpu, cuda, cuda:N or mps\\)"),
        ("train.dtype=fp8", "train.dtype='fp8' \\(expected one of auto, float32, bfloat16, float16\\)"),
        ("checkpoint.keep_last=-1", r"checkpoint.keep_last=-1 \(expected >= 0\)"),
        ("log.every=0", r"log.every=0 \(expected >= 1\)"),
        ("train.seed=-5", r"train.seed=-5 \(expected in \[0, 2\*\*63\)\)"),
        ("train.seed=99999999999999999999", r"train.seed=99999999999999999999 \(expected in \[0, 2\*\*63\)\)"),
    ],
)
def test_out_of_range_values_are_one_line_naming_key_value_and_range(override, message):
    with pytest.raises(GptforgeError, match=message):
        load_config("tiny", [override])


@pytest.mark.parametrize("n_head", [24, 8])
def test_rotary_with_an_odd_head_size_is_refused_naming_the_keys(n_head):
    with pytest.raises(GptforgeError, match=r"model.position=rotary needs an even head size, but model.n_embd=.* / "):
        load_config("tiny", ["model.position=rotary", "model.n_embd=24", f"model.n_head={n_head}"])
    load_config("tiny", ["model.position=learned", "model.n_embd=24", f"model.n_head={n_head}"])  # no pairs needed


def test_values_are_checked_in_presets_and_checkpoints_too(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_embd = 64\nn_head = 3\n")
    with pytest.raises(GptforgeError, match="model.n_head=3 must divide model.n_embd=64"):
        load_config(str(bad))
    bad.write_bytes(b"[train]\nprompt = '\xff'\n")
    with pytest.raises(GptforgeError, match=r"bad\.toml: expected UTF-8 text"):
        load_config(str(bad))
    saved = to_dict(load_config("tiny"))
    saved["optim"]["beta2"] = 1.0
    with pytest.raises(GptforgeError, match=r"checkpoint config: optim.beta2=1.0 \(expected in \[0, 1\)\)"):
        config_from_dict(saved)


def test_a_device_this_machine_lacks_is_one_line():
    from gptforge.runtime.device import resolve_device

    if not torch.backends.mps.is_available():
        with pytest.raises(GptforgeError, match="train.device='mps': Apple MPS is not available on this machine"):
            resolve_device("mps")
    with pytest.raises(GptforgeError, match=r"train.device='cuda:\d+': "):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(GptforgeError, match=r"^train.device='cpu:1': expected auto, cpu, cuda, cuda:N or mps$"):
        resolve_device("cpu:1")  # one CPU device: safetensors then refused it, a traceback
    assert resolve_device("cpu:0") == torch.device("cpu") and resolve_device("cpu:0").index is None
