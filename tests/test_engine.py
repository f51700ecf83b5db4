"""The training engine: DDP equivalence, exact resume after SIGTERM, crash-safe checkpoints, stability."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gptforge.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gptforge.config import OptimConfig, load_config
from gptforge.errors import GptforgeError
from gptforge.model import GPT
from gptforge.optim import lr_at
from gptforge.trainer import train


def losses(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


def cli(*args):
    return [sys.executable, "-m", "gptforge", *map(str, args)]


def weights(ckpt):
    return load_checkpoint(ckpt)[0].state_dict()


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
        "model.dropout=0.1",
        "--set",
        "eval.sample_tokens=0",
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


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_leaves_a_loadable_checkpoint(tmp_path):
    writer = f"""
import torch
from gptforge.checkpoint import save_checkpoint
from gptforge.config import Config
from gptforge.model import GPT, GPTConfig
from gptforge.tokenizer import load_tokenizer
cfg = Config(model=GPTConfig(block_size=64, vocab_size=50257, n_layer=4, n_head=4, n_embd=256))
model, tok = GPT(cfg.model), load_tokenizer("gpt2")
opt = torch.optim.AdamW(model.parameters())
model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
opt.step()
step = 0
while True:
    step += 1
    save_checkpoint({str(tmp_path)!r}, step, model, opt, cfg, tok, {{"tokens": 0, "max_steps": 0, "loader": {{}}}})
    print(step, flush=True)
"""
    for delay in (0.03, 0.11, 0.27, 0.5):  # staggered so the kills land in different phases of a write
        proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # the first checkpoint is complete
        time.sleep(delay)
        proc.kill()
        proc.wait()
        ckpt = latest_checkpoint(tmp_path)
        assert ckpt is not None
        model, _, _, meta = load_checkpoint(ckpt)
        torch.load(ckpt / "optimizer.pt", weights_only=True)
        assert meta["step"] >= 1 and model.config.n_embd == 256


def test_wsd_and_constant_schedules():
    wsd = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lr_at(0, wsd, 100) == pytest.approx(0.1)
    assert lr_at(50, wsd, 100) == 1.0 and lr_at(79, wsd, 100) == 1.0
    assert lr_at(90, wsd, 100) == pytest.approx(0.55)
    assert lr_at(100, wsd, 100) == pytest.approx(0.1)
    const = OptimConfig(lr=2.0, warmup_steps=4, schedule="constant")
    assert [lr_at(s, const, 100) for s in (0, 3, 50)] == [0.5, 2.0, 2.0]
    with pytest.raises(GptforgeError, match="optim.schedule='linear'"):
        lr_at(0, OptimConfig(schedule="linear"), 10)


def test_non_finite_steps_are_skipped_then_stop(data_dir, tmp_path, monkeypatch):
    original = GPT.forward
    poisoned = {"calls": 0}

    def forward(self, idx, targets=None, cache=None):
        logits, loss = original(self, idx, targets, cache)
        if self.training and loss is not None:
            poisoned["calls"] += 1
            if poisoned["calls"] in poisoned["bad"]:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    poisoned["bad"] = {3, 4}  # step 2's two micro-batches
    result = train(load_config("tiny", [f"data.path={data_dir}", "train.max_steps=6"]), tmp_path / "a")
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["skipped"] for r in train_records] == [0, 1, 1, 1, 1, 1]
    assert math.isfinite(result.last_val["loss"])

    poisoned["calls"], poisoned["bad"] = 0, set(range(1000))
    cfg = load_config("tiny", [f"data.path={data_dir}", "train.max_steps=20", "train.max_skips=3"])
    with pytest.raises(GptforgeError, match=r"3 steps in a row .* the last at step 3; last good checkpoint: none"):
        train(cfg, tmp_path / "b")


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


def test_gpt2_124m_preset_starts_on_cpu(data_dir, tmp_path):
    small = [
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.micro_batch=4",
        "train.batch_tokens=256",
        "train.max_steps=2",
        "train.compile=false",
        "eval.tokens=256",
        "train.dtype=float32",
        f"data.path={data_dir}",
    ]
    cfg = load_config("gpt2-124m", small)
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio) == (6e-4, 715, 0.1)
    assert (cfg.eval.every, cfg.checkpoint.every) == (250, 5000)
    assert load_config("gpt2-124m").train.batch_tokens == 524_288 == 64 * 1024 * 8
    result = train(cfg, tmp_path / "r")
    assert result.steps == 2


def test_checkpoint_holds_rng_state(tmp_path):
    from gptforge.config import Config
    from gptforge.model import GPTConfig
    from gptforge.tokenizer import load_tokenizer

    cfg = Config(model=GPTConfig(block_size=8, vocab_size=50257, n_layer=1, n_head=1, n_embd=8))
    torch.manual_seed(123)
    ckpt = save_checkpoint(tmp_path, 1, GPT(cfg.model), None, cfg, load_tokenizer("gpt2"))
    expected = torch.rand(3)
    state = torch.load(ckpt / "rng_rank0.pt", weights_only=True)
    torch.manual_seed(0)
    from gptforge.checkpoint import set_rng_state

    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_compiled_training_matches_eager_and_keeps_eval_and_sampling(data_dir, tmp_path):
    base = [f"data.path={data_dir}", "train.max_steps=3"]
    eager = train(load_config("tiny", base), tmp_path / "eager")
    compiled = train(load_config("tiny", [*base, "train.compile=true"]), tmp_path / "compiled")
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a)
    assert compiled.last_val["loss"] == pytest.approx(eager.last_val["loss"], abs=1e-4)
    assert len((tmp_path / "compiled" / "samples.jsonl").read_text().splitlines()) == 2


def test_activation_checkpointing_gives_the_same_gradients():
    from gptforge.model import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=16))
    x = torch.randint(0, 100, (2, 16))
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.activation_checkpointing = flag
        model(x, x)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)


def test_batch_ramp_grows_the_step(data_dir, tmp_path):
    cfg = load_config(
        "tiny",
        [
            f"data.path={data_dir}",
            "train.max_steps=5",
            "train.batch_tokens=512",
            "train.batch_ramp_tokens=600",
            "eval.every=0",
        ],
    )
    result = train(cfg, tmp_path / "r")
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    tokens = [r["tokens"] for r in records if r["kind"] == "train"]
    # 128 tokens per micro-batch, up to 4: ceil(4 * (seen + 1) / 600) micro-batches per step.
    assert tokens == [128, 256, 512, 1024, 1536] and result.tokens == 1536  # 1, 1, 2, 4, 4 micro-batches


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
