"""Checkpoint cadence and pruning during training."""

from gptforge.config import load_config
from gptforge.train.trainer import train


def test_keep_last_checkpoints_and_milestones(data_dir, tmp_path):
    cfg = load_config(
        "tiny",
        [
            f"data.path={data_dir}",
            "train.max_steps=10",
            "checkpoint.every=1",
            "checkpoint.keep_last=2",
            "checkpoint.milestone_every=4",
            "eval.every=0",
        ],
    )
    train(cfg, tmp_path / "r")
    kept = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000008", "step_000009", "step_000010"]
