"""A folder of two tiny runs, trained once per session, for the server's tests."""

from __future__ import annotations

import json
import shutil

import pytest

from gptforge.config import load_config
from gptforge.train.trainer import train


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory, data_dir):
    """runs/alpha: 4 steps, checkpoints at 2 and 4, evaluation and samples every 2; runs/beta: its copy with
    higher losses, so the page has a second run to overlay."""
    root = tmp_path_factory.mktemp("runs")
    overrides = [f"data.path={data_dir}", "train.max_steps=4", "eval.every=2", "checkpoint.every=2"]
    train(load_config("tiny", overrides), root / "alpha")
    shutil.copytree(root / "alpha", root / "beta")
    records = [json.loads(line) for line in (root / "beta" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if isinstance(r.get("loss"), float):
            r["loss"] += 0.5
    (root / "beta" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root
