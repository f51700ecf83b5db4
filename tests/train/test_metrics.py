"""metrics.jsonl (strict JSON, restarts), TensorBoard event files and W&B runs (offline, or failing to start)."""

import json
import math

import pytest

from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.rundir import METRICS, read_metrics
from gptforge.train.metrics import MetricsLog
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

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert "config/text_summary" in events.Tags()["tensors"]  # the settings beside the curves

    resumed = load_config("tiny", [f"data.path={data_dir}", "train.max_steps=3", "log.wandb=gptforge-test"])
    train(resumed, tmp_path / "r", resume="auto")
    run_id = (tmp_path / "r" / "wandb_id").read_text()
    runs = sorted(p.name for p in (tmp_path / "r" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs)  # one W&B run, continued


def test_metrics_are_strict_json_and_a_restart_supersedes_what_it_redoes(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.write("train", 1, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=8, tokens_per_s=1.0)
        log.write("train", 2, loss=math.nan, lr=1e-3, grad_norm=math.inf, tokens=16, tokens_per_s=1.0)
        log.write("val", 2, loss=1.5, ppl=4.5, bpb=2.0)
        log.write("train", 3, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=24, tokens_per_s=1.0)  # past the checkpoint
        log.write("resume", 2, checkpoint="step_000002", changes=[])
        log.write("train", 3, loss=0.9, lr=1e-3, grad_norm=1.0, tokens=24, tokens_per_s=1.0)
    lines = (tmp_path / METRICS).read_text().splitlines()
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert json.loads(lines[1])["loss"] is None  # json.loads accepts NaN; strict readers do not
    records = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in records["train"]] == [(1, 2.0), (2, None), (3, 0.9)]
    assert [r["step"] for r in records["val"]] == [2]


def test_a_line_torn_by_a_crash_is_dropped_before_a_resume_appends(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.write("train", 1, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=8, tokens_per_s=1.0)
    path = tmp_path / METRICS
    path.write_text(path.read_text() + '{"kind": "train", "step": 2, "lo')  # a kill -9 mid-append
    with MetricsLog(tmp_path) as log:  # the resumed run; the torn record was appended to: line 2 unreadable
        log.write("train", 2, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=16, tokens_per_s=1.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)["train"]] == [(1, 2.0), (2, 1.0)]
    path.write_text('{"kind": "train", "st')  # torn alone: the file starts over
    MetricsLog(tmp_path).close()
    assert path.read_text() == ""


def test_a_wandb_that_cannot_start_is_one_line(data_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_login)
    cfg = load_config("tiny", [f"data.path={data_dir}", "train.max_steps=1", "log.wandb=proj"])
    with pytest.raises(GptforgeError, match=r"log.wandb=proj: W&B could not start \(api_key not configured"):
        train(cfg, tmp_path / "r")
