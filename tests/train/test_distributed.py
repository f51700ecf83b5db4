"""DDP: 2 gloo processes equal 1 process with twice the accumulation, with and without ZeRO."""

import os
import subprocess
import sys

import pytest
import torch
from tests.helpers import cli, losses, weights

from gptforge.checkpoint import latest_checkpoint


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_double_accumulation(data_dir, tmp_path):
    common = [
        "--config",
        "tiny",
        "--data",
        data_dir,
        "--set",
        "train.max_steps=6",
        "--set",
        "eval.every=3",
        "--set",
        "eval.sample_tokens=0",
    ]
    # 1 process x 4 micro-batches of 4 x 32  ==  2 processes x 2 micro-batches each.
    one = subprocess.run(
        cli("train", *common, "--out", tmp_path / "one", "--set", "train.batch_tokens=512"),
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr

    def two_processes(out, *settings):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
        args = [*launcher, "gptforge", "train", *map(str, common), "--out", str(out), "--set", "train.batch_tokens=512"]
        for setting in settings:
            args += ["--set", setting]
        run = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    two = two_processes(tmp_path / "two")
    assert "2 processes x 2 accumulation" in two.stdout and "1 process x 4 accumulation" in one.stdout
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    for (name, x), y in zip(weights(tmp_path / "one").items(), weights(tmp_path / "two").values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)
    val_one, val_two = losses(tmp_path / "one", "val"), losses(tmp_path / "two", "val")
    assert val_one.keys() == val_two.keys() == {0, 3, 6}  # evaluation sharded over ranks gives one process's number
    assert all(abs(val_one[s] - val_two[s]) <= 1e-5 for s in val_one), (val_one, val_two)

    # ZeRO: the same run with AdamW's state sharded over the two processes.
    two_processes(tmp_path / "zero", "train.zero=true")
    z = losses(tmp_path / "zero")
    assert all(abs(a[s] - z[s]) <= 1e-5 for s in a)
    state = torch.load(latest_checkpoint(tmp_path / "zero") / "optimizer.pt", weights_only=True)
    assert len(state["state"]) == len(list(weights(tmp_path / "zero"))) - 1  # every parameter (tied once)
