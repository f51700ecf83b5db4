"""Metric sinks: TensorBoard event files and offline W&B runs."""

import pytest

from gptforge.config import load_config
from gptforge.train.trainer import train


def test_tensorboard_and_offline_wandb_sinks(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        "tiny", [f"data.path={data_dir}", "train.max_steps=2", "log.tensorboard=true", "log.wandb=gptforge-test"]
    )
    train(cfg, tmp_path / "r")
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "r" / "wandb").glob("offline-run-*"))
