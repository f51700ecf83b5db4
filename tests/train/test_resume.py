"""Exact resume: a run stopped by SIGTERM and resumed equals one that never stopped, dropout and samples included."""

import json
import signal
import subprocess
import time

import pytest
import torch
from tests.helpers import cli, losses, weights

from gptforge.checkpoint import latest_checkpoint


@pytest.mark.slow
def test_sigterm_saves_and_resume_is_exact(data_dir, tmp_path):
    args = [
        "--config",
        "tiny",
        "--data",
        data_dir,
        "--set",
        "train.max_steps=150",
        "--set",
        "eval.every=0",
        "--set",
        "model.dropout=0.1",  # with the in-training samples on: they must not draw from the training RNG
    ]
    straight = subprocess.run(cli("train", *args, "--out", tmp_path / "a"), capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr

    proc = subprocess.Popen(
        cli("train", *args, "--out", tmp_path / "b"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "b" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 20):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    stopped = latest_checkpoint(tmp_path / "b")
    k = json.loads((stopped / "meta.json").read_text())["step"]
    assert 10 < k < 150 and "stopping at step" in out

    resumed = subprocess.run(
        cli("train", *args, "--out", tmp_path / "b", "--resume", "auto"), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [a[s] for s in range(k + 1, 151)] == [b[s] for s in range(k + 1, 151)]  # bitwise the same losses
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
