"""The training loop end to end on the tiny preset: artifacts, resume, budget, stability, compile, batch ramp."""

import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.helpers import losses

from gptforge.checkpoint import latest_checkpoint, load_checkpoint
from gptforge.cli import main
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT
from gptforge.runtime.distributed import SINGLE
from gptforge.train.evaluator import Evaluator
from gptforge.train.metrics import NullLog
from gptforge.train.optim import lr_at
from gptforge.train.setup import PROMPTS, Data, open_data, resolve_config
from gptforge.train.trainer import train


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


def test_checkpoint_reloads_to_the_same_model(data_dir, tmp_path, capsys):
    result = train(tiny_cfg(data_dir, "train.max_steps=3", "eval.tokens=320"), tmp_path / "run")
    model, tok, cfg, meta = load_checkpoint(result.checkpoint)
    assert meta["step"] == 3 and tok.name == "gpt2" and cfg.model.vocab_size == 50257
    x = torch.randint(0, 50257, (2, 16))
    _, loss = model(x, x)
    assert torch.isfinite(loss)
    assert not any(p.name.startswith(".") for p in (tmp_path / "run" / "checkpoints").iterdir())
    # `gptforge eval` with its defaults scores the tokens the final evaluation did (10 windows: not whole batches
    # of training's 4 nor eval's 8), so the same loss; the batch size changes only the summation's rounding.
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--data", str(data_dir), "--json"]) == 0
    val = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val"]
    assert val["tokens"] == result.last_val["tokens"] == 320
    assert val["loss"] == pytest.approx(result.last_val["loss"], abs=1e-5)


MODERN = [
    "model.norm=rmsnorm", "model.position=rotary", "model.qk_norm=true", "model.bias=false",
    "model.tie_embeddings=false", "model.mlp=relu2", "model.zero_init=true", "optim.optimizer=muon",
    "optim.schedule=wsd",
]  # fmt: skip


@pytest.mark.parametrize("recipe", [[], MODERN], ids=["gpt2", "modern-muon"])
def test_resume_continues_where_it_stopped(data_dir, tmp_path, recipe):
    straight = train(tiny_cfg(data_dir, "train.max_steps=6", "checkpoint.every=3", *recipe), tmp_path / "a")
    train(tiny_cfg(data_dir, "train.max_steps=6", "checkpoint.every=3", *recipe), tmp_path / "b")
    # Drop the final checkpoint and metrics, then resume from step 3.
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000006")
    (tmp_path / "b" / "metrics.jsonl").unlink()
    resumed = train(
        tiny_cfg(data_dir, "train.max_steps=6", "checkpoint.every=3", *recipe), tmp_path / "b", resume="auto"
    )
    a, _, _, _ = load_checkpoint(straight.checkpoint)
    b, _, _, _ = load_checkpoint(resumed.checkpoint)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_time_budget_cuts_the_step_count(data_dir, tmp_path):
    """End to end: the run stops long before max_steps and saves where it stopped (how many steps fit depends on
    the machine's load, so the count itself is checked on a fake clock below)."""
    result = train(tiny_cfg(data_dir, "train.max_steps=100000", "train.time_budget=4", "eval.every=0"), tmp_path / "r")
    assert 1 <= result.steps < 100000
    assert result.checkpoint.name == f"step_{result.steps:06d}"


@pytest.mark.parametrize("paces", [(1.0, 2.0), (2.0, 1.0)], ids=["slows down", "speeds up"])
def test_a_time_budget_on_a_clock_that_changes_pace_halfway_ends_its_decay_on_time(
    data_dir, tmp_path, monkeypatch, capsys, paces
):
    """The trainer on a fake clock: a step takes 1 s, then 2 s from 30 s on (or the other way), and a validation
    token 0.05 s (the whole split, 24 s: a slow host's). The evaluations are cut to fit, and the step count is
    planned again as the pace drifts, so the run ends on its schedule's last step (the learning rate decayed, never
    rising when a plan grew) within the budget."""
    import gptforge.train.evaluator as evaluator
    import gptforge.train.trainer as trainer

    clock = {"now": 0.0}
    step, score = trainer.train_step, evaluator.evaluate_loss

    def slow_step(*args, **kwargs):
        clock["now"] += paces[0] if clock["now"] < 30 else paces[1]
        return step(*args, **kwargs)

    def slow_score(*args, **kwargs):
        result = score(*args, **kwargs)
        clock["now"] += 0.05 * result["tokens"]
        return result

    monkeypatch.setattr(trainer, "train_step", slow_step)
    monkeypatch.setattr(evaluator, "evaluate_loss", slow_score)
    for module in (trainer, evaluator):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    cfg = tiny_cfg(data_dir, "train.max_steps=100000", "train.time_budget=80", "eval.every=0", "optim.warmup_steps=2")
    result = train(cfg, tmp_path / "r")
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    assert clock["now"] <= 80 + 2 and result.steps == len(lrs) >= 30  # the stated tolerance: one step
    assert lrs[-1] == lr_at(len(lrs) - 1, cfg.optim, len(lrs))  # the schedule's last step, whatever the plans
    assert lrs[-1] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio, rel=0.1)  # the decay ended
    assert lrs[2:] == sorted(lrs[2:], reverse=True)  # after the warm-up, never up
    # An evaluation may take an eighth of the budget, 10 s: 192 tokens (6 windows), said; the first and the final
    # one score the same, and the run's config says so (`gptforge eval` scores them too).
    out = capsys.readouterr().out
    assert "evaluating 192 validation tokens rather than" in out and "evaluating: 192 validation tokens" in out
    assert result.first_val["tokens"] == result.last_val["tokens"] == 192 == result.config.eval.tokens
    # The epochs said are those of the budget's plan, not of train.max_steps.
    planned = int(re.search(r"time budget 80s: [\d.]+s/step -> (\d+) steps", out)[1])
    assert f"the planned {planned * 256:,} tokens are" in out and "25,600,000" not in out


def test_batch_must_divide(data_dir, tmp_path):
    with pytest.raises(GptforgeError, match="train.batch_tokens=100 must be a positive multiple"):
        train(tiny_cfg(data_dir, "train.batch_tokens=100"), tmp_path / "r")


def test_a_model_larger_than_the_machines_memory_is_refused_before_it_is_built(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("gptforge.train.setup.physical_memory", lambda: 2**30)
    message = r"the model has 3,200,026,496 parameters \(11.9 GiB in fp32\), more than this machine's 1.0 GiB"
    with pytest.raises(GptforgeError, match=message):
        train(tiny_cfg(data_dir, "model.vocab_multiple=100000000"), tmp_path / "r")


def test_an_empty_sample_prompt_starts_a_fresh_document(data_dir, tmp_path):
    train(tiny_cfg(data_dir, "train.max_steps=1", "eval.prompt=", "eval.sample_tokens=4"), tmp_path / "r")
    samples = [json.loads(line) for line in (tmp_path / "r" / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in samples] == ["", ""]  # at the first and the last step


def test_missing_data(tmp_path):
    with pytest.raises(GptforgeError, match="no manifest.json"):
        train(tiny_cfg(tmp_path / "nowhere"), tmp_path / "r")


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


def test_a_diverging_run_ends_by_the_skip_rule_with_samples_and_evaluation_on(data_dir, tmp_path):
    overrides = ["optim.lr=1000", "optim.warmup_steps=1", "train.max_steps=60", "eval.every=3", "checkpoint.every=2"]
    with pytest.raises(GptforgeError, match=r"10 steps in a row with a non-finite loss .*, the last at step") as caught:
        train(tiny_cfg(data_dir, *overrides), tmp_path / "r")
    found = re.search(r"the last at step (\d+); last good checkpoint: (\S+) \(lower optim.lr", str(caught.value))
    streak_start, good = int(found.group(1)) - 9, Path(found.group(2))
    assert int(good.name.removeprefix("step_")) == streak_start - 1 and good.parent == tmp_path / "r" / "checkpoints"
    assert all(torch.isfinite(w).all() for w in load_checkpoint(good)[0].state_dict().values())
    with pytest.raises(GptforgeError, match=r"steps in a row with a non-finite loss "):
        train(tiny_cfg(data_dir, *overrides), tmp_path / "r", resume="auto")
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert "NaN" not in metrics and "Infinity" not in metrics


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


@pytest.mark.slow
def test_compiled_training_matches_eager_and_keeps_eval_and_sampling(data_dir, tmp_path):
    base = [f"data.path={data_dir}", "train.max_steps=3"]
    eager = train(load_config("tiny", base), tmp_path / "eager")
    compiled = train(load_config("tiny", [*base, "train.compile=true"]), tmp_path / "compiled")
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a)
    assert compiled.last_val["loss"] == pytest.approx(eager.last_val["loss"], abs=1e-4)
    assert len((tmp_path / "compiled" / "samples.jsonl").read_text().splitlines()) == 2


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


def test_auto_precision_is_measured_recorded_and_kept_on_resume(data_dir, tmp_path, monkeypatch):
    from gptforge.runtime import device

    # A CPU that reports native bf16 but runs it slower than fp32 (the Xeon of RESULTS.md) trains in fp32.
    device.cpu_bf16_is_faster.cache_clear()
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(
        "gptforge.runtime.flops.cpu_matmul_flops", lambda dtype, **_: {torch.bfloat16: 150e9}.get(dtype, 270e9)
    )
    assert device.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    train(tiny_cfg(data_dir, "train.dtype=auto", "train.max_steps=2", "checkpoint.every=2"), tmp_path / "run")
    assert 'dtype = "float32"' in (tmp_path / "run" / "config.toml").read_text()
    # The same machine now measuring bf16 faster does not change a resumed run's precision.
    device.cpu_bf16_is_faster.cache_clear()
    monkeypatch.setattr(
        "gptforge.runtime.flops.cpu_matmul_flops", lambda dtype, **_: {torch.bfloat16: 700e9}.get(dtype, 270e9)
    )
    assert device.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    result = train(tiny_cfg(data_dir, "train.dtype=auto", "train.max_steps=4"), tmp_path / "run", resume="auto")
    assert result.config.train.dtype == "float32" and result.steps == 4
    device.cpu_bf16_is_faster.cache_clear()


def test_train_threads_sets_the_cpu_threads_and_slow_matmuls_are_warned_of(data_dir, tmp_path, capsys, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("gptforge.train.setup.peak_flops", lambda *a: (1e9, "measured CPU float32 matmul"))
    try:
        train(tiny_cfg(data_dir, "train.max_steps=1", "train.threads=1"), tmp_path / "r")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "1 thread each" in out
    assert "warning: matmuls ran at 1 GFLOP/s on 1 thread, far below an idle core's" in out
    monkeypatch.setattr("gptforge.train.setup.peak_flops", lambda *a: (1e12, "measured CPU float32 matmul"))
    train(tiny_cfg(data_dir, "train.max_steps=1"), tmp_path / "r2")
    assert "warning: matmuls" not in capsys.readouterr().out


@pytest.mark.parametrize("per_thread, busy", [((100e9, 190e9), False), ((100e9, 70e9), True)])
def test_threads_that_barely_outrun_one_suggest_one_thread(monkeypatch, per_thread, busy):
    from gptforge.runtime import threads

    monkeypatch.setattr(threads, "sustained_matmul_flops", lambda n, dtype, seconds: per_thread[n - 1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        line = threads.busy_warning(100e9, torch.float32)
        assert (line is not None) == busy and torch.get_num_threads() == 2
        if busy:
            assert "2 threads ran matmuls 0.70x as fast as one" in line and "try train.threads=1" in line
    finally:
        torch.set_num_threads(before)


def test_the_first_evaluation_is_announced_and_the_first_step_is_printed(data_dir, tmp_path, capsys):
    # More validation tokens asked for than the split holds: the announcement says what is scored.
    train(tiny_cfg(data_dir, "train.max_steps=6", "log.every=5", "eval.every=0", "eval.tokens=99999"), tmp_path / "r")
    lines = capsys.readouterr().out.splitlines()
    announced = next(i for i, line in enumerate(lines) if "evaluating: " in line)
    tokens = re.search(r"evaluating: ([\d,]+) validation tokens", lines[announced])[1]
    assert f"over {tokens} tokens" in "".join(lines[announced + 1 : announced + 3])  # what is said is what is scored
    printed = [line.split("|")[0].split()[1] for line in lines if line.startswith("step") and "| loss" in line]
    assert printed == ["1/6", "5/6", "6/6"]
    assert sum("evaluating: " in line for line in lines) == 1  # the final evaluation is not announced again


def test_a_run_without_a_validation_split_says_its_evaluations_are_skipped(data_dir, tmp_path, capsys):
    cfg = tiny_cfg(data_dir, "eval.hellaswag=")
    data = open_data(cfg)
    train_only = [{**m, "shards": [s for s in m["shards"] if s["split"] == "train"]} for m in data.manifests]
    evaluate = Evaluator(cfg, None, Data(data.sources, train_only, data.tokenizer, False), NullLog(), tmp_path, SINGLE)
    assert evaluate(0) is None
    assert capsys.readouterr().out.count(f"{data_dir}: no validation split: no evaluations (validation loss") == 1
    odd = Data([dataclasses.replace(data.sources[0], path="new\nline")], train_only, data.tokenizer, False)
    Evaluator(cfg, None, odd, NullLog(), tmp_path, SINGLE)
    assert "new\\nline: no validation split" in capsys.readouterr().out  # one line, the folder's newline escaped


def _with_languages(data, languages):
    manifests = [{**m, "report": {"languages": {k: {"read": n, "kept": n} for k, n in languages.items()}}} for m in
                 data.manifests]  # fmt: skip
    return Data(data.sources, manifests, data.tokenizer, data.mixed)


def test_the_sample_prompt_follows_the_datas_main_language(data_dir):
    data = open_data(tiny_cfg(data_dir))
    assert resolve_config(tiny_cfg(data_dir), data)[0].eval.prompt == "def fibonacci(n):"  # the corpus is Python
    c_data = _with_languages(data, {"C": 30, "Python": 2, "Markdown": 5})
    assert resolve_config(tiny_cfg(data_dir), c_data)[0].eval.prompt == PROMPTS["C"]
    web = _with_languages(data, {"unknown": 50, "Python": 1})  # JSONL records, say: no language to follow
    assert resolve_config(tiny_cfg(data_dir), web)[0].eval.prompt == ""
    assert resolve_config(tiny_cfg(data_dir, "eval.prompt=int x"), c_data)[0].eval.prompt == "int x"  # set: kept
    assert load_config("modern-cpu").eval.prompt == load_config("demo-cpu").eval.prompt == "auto"
