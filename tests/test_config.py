import sys

import pytest

from gptforge.config import describe, load_config, preset_names, to_toml
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
