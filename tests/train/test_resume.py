"""Exact resume: a run stopped by SIGTERM and resumed equals one that never stopped, dropout, samples and HellaSwag
included, in one process and in two (with ZeRO)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tests.eval.test_hellaswag import write_examples
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
    straight = subprocess.run(cli("train", *args, "--out", tmp_path / "a"), capture_output=True, text=True, timeout=600)
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
        cli("train", *args, "--out", tmp_path / "b", "--resume", "auto"), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [a[s] for s in range(k + 1, 151)] == [b[s] for s in range(k + 1, 151)]  # bitwise the same losses
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["train.zero=true", "train.parallel=fsdp"])
def test_two_processes_with_zero_resume_exactly_with_dropout_samples_and_hellaswag(data_dir, tmp_path, sharding):
    write_examples(tmp_path / "h.jsonl", n=4, labels=[0, 1, 2, 3])
    settings = [
        "train.max_steps=40",
        "train.batch_tokens=512",
        sharding,
        "model.dropout=0.1",
        "eval.every=7",  # evaluation, HellaSwag and samples at steps the stop does not fall on as well
        f"eval.hellaswag={tmp_path / 'h.jsonl'}",
    ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]

    def command(out, *extra):
        args = [*launcher, "gptforge", "train", "--config", "tiny", "--data", str(data_dir), "--out", str(out)]
        return args + [a for s in settings for a in ("--set", s)] + list(extra)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = subprocess.run(command(tmp_path / "a"), capture_output=True, text=True, env=env, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    agent = subprocess.Popen(
        command(tmp_path / "b"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    metrics = tmp_path / "b" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count('"train"') < 10):
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True, timeout=30)
    for pid in workers.stdout.split():  # a pre-empted job: the scheduler signals every task
        os.kill(int(pid), signal.SIGTERM)
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err[-3000:]
    k = json.loads((latest_checkpoint(tmp_path / "b") / "meta.json").read_text())["step"]
    assert 10 <= k < 40 and "stopping at step" in out

    resumed = subprocess.run(
        command(tmp_path / "b", "--resume", "auto"), capture_output=True, text=True, env=env, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [a[s] for s in range(k + 1, 41)] == [b[s] for s in range(k + 1, 41)]
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_resuming_a_complete_run_trains_nothing_and_changes_nothing(data_dir, tmp_path, capsys):
    from gptforge.config import load_config
    from gptforge.train.trainer import train

    cfg = load_config("tiny", [f"data.path={data_dir}", "train.max_steps=2", "eval.every=0"])
    train(cfg, tmp_path / "run")

    def contents():  # but the lock, which every command on the folder takes
        found = (p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock")
        return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in found}

    files = contents()
    capsys.readouterr()
    result = train(cfg, tmp_path / "run", resume="auto")  # a scheduler retrying a job that had finished
    assert "complete at step 2 of 2; nothing to train" in capsys.readouterr().out
    assert result.steps == 2 and result.checkpoint == latest_checkpoint(tmp_path / "run")
    assert contents() == files  # no second evaluation logged, no checkpoint written again
