import json
import math

import pytest
import torch

from gptforge.checkpoint import latest_checkpoint, load_checkpoint
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.trainer import train


def tiny_cfg(data_dir, *overrides):
    return load_config("tiny", [f"data.path={data_dir}", *overrides])


def test_loss_falls_and_artifacts_are_written(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, "train.max_steps=40", "eval.every=20", "optim.lr=1e-2", "optim.warmup_steps=5")
    result = train(cfg, tmp_path / "run")
    assert result.steps == 40 and result.tokens == 40 * 256
    assert result.first_val["loss"] == pytest.approx(math.log(50257), abs=0.3)  # untrained ~ uniform
    assert result.last_val["loss"] < result.first_val["loss"] - 4.0  # the templated corpus is easy
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(train_losses) == 40 and sum(train_losses[-5:]) / 5 < train_losses[0] - 4.0
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 20, 40]
    assert (tmp_path / "run" / "config.toml").is_file()
    assert len((tmp_path / "run" / "samples.jsonl").read_text().splitlines()) == 3
    assert latest_checkpoint(tmp_path / "run") == result.checkpoint


def test_checkpoint_reloads_to_the_same_model(data_dir, tmp_path):
    result = train(tiny_cfg(data_dir, "train.max_steps=3"), tmp_path / "run")
    model, tok, cfg, meta = load_checkpoint(result.checkpoint)
    assert meta["step"] == 3 and tok.name == "gpt2" and cfg.model.vocab_size == 50257
    x = torch.randint(0, 50257, (2, 16))
    _, loss = model(x, x)
    assert torch.isfinite(loss)
    assert not any(p.name.startswith(".") for p in (tmp_path / "run" / "checkpoints").iterdir())


def test_resume_continues_where_it_stopped(data_dir, tmp_path):
    straight = train(tiny_cfg(data_dir, "train.max_steps=6", "checkpoint.every=3"), tmp_path / "a")
    train(tiny_cfg(data_dir, "train.max_steps=6", "checkpoint.every=3"), tmp_path / "b")
    # Drop the final checkpoint and metrics, then resume from step 3.
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000006")
    (tmp_path / "b" / "metrics.jsonl").unlink()
    resumed = train(tiny_cfg(data_dir, "train.max_steps=6", "checkpoint.every=3"), tmp_path / "b", resume="auto")
    a, _, _, _ = load_checkpoint(straight.checkpoint)
    b, _, _, _ = load_checkpoint(resumed.checkpoint)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_time_budget_cuts_the_step_count(data_dir, tmp_path):
    result = train(tiny_cfg(data_dir, "train.max_steps=100000", "train.time_budget=4", "eval.every=0"), tmp_path / "r")
    assert 5 <= result.steps < 100000
    assert result.seconds < 15


def test_batch_must_divide(data_dir, tmp_path):
    with pytest.raises(GptforgeError, match="train.batch_tokens=100 must be a positive multiple"):
        train(tiny_cfg(data_dir, "train.batch_tokens=100"), tmp_path / "r")


def test_missing_data(tmp_path):
    with pytest.raises(GptforgeError, match="no manifest.json"):
        train(tiny_cfg(tmp_path / "nowhere"), tmp_path / "r")
