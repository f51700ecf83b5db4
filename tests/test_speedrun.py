"""`gptforge speedrun`: both recipes on one corpus, budget and seeds; time to quality read from the curves."""

import json
import math
import subprocess
import time

import pytest
import torch
from tests.helpers import cli

import gptforge.speedrun
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.speedrun import Curve, PaceMeter, Probe, compare, format_summary, read_curve, speedrun

MODERN_TINY = """
[model]
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
norm = "rmsnorm"
position = "rotary"
qk_norm = true
bias = false
tie_embeddings = false
mlp = "swiglu"
zero_init = true

[optim]
optimizer = "muon"
lr = 3e-3
warmup_steps = 2
schedule = "wsd"

[train]
micro_batch = 4
batch_tokens = 256
dtype = "float32"
seed = 5  # the baseline preset's seeds are used for both recipes
"""


def test_time_to_a_quality_interpolates_between_evaluations():
    c = Curve(seconds=[0.0, 10.0, 20.0], bpb=[3.0, 2.0, 1.0], steps=20)
    assert c.time_to(1.5) == pytest.approx(15.0)
    assert c.time_to(2.0) == pytest.approx(10.0)
    assert c.time_to(3.5) == 0.0
    assert c.time_to(0.5) is None


def test_time_to_a_quality_equal_to_an_evaluation_is_that_evaluation_s_time():
    c = Curve(seconds=[0.0, 10.0, 20.0, 30.0], bpb=[3.0, 2.0, 2.5, 1.0], steps=30)
    assert [c.time_to(b) for b in (3.0, 2.0, 1.0)] == [0.0, 10.0, 30.0]  # the first, a later one, the last
    assert c.time_to(c.final) == 30.0  # a curve reaches its own final quality
    base = Curve([0.0, 10.0, 20.0], [3.0, 2.5, 2.0], 20)
    result = compare({"gpt2": base, "modern": c}, "gpt2", "modern")
    assert result["time_to_baseline_final"] == pytest.approx(10.0) and result["time_share"] == pytest.approx(0.5)
    assert result["modern"]["final_bpb"] == 1.0
    # Lower where the shorter run ended, not at the ends: at 20 s the candidate was at 2.5, above the baseline's 2.0.
    assert not result["lower_at_equal_time"] and c.at(20.0) == 2.5 and c.at(25.0) == pytest.approx(1.75)
    assert compare({"gpt2": base, "modern": Curve([0.0, 10.0, 20.0], [3.0, 2.0, 1.9], 20)}, "gpt2", "modern")[
        "lower_at_equal_time"
    ]
    # Two evaluations locate no crossing: no time share, no verdict, and the count is said.
    short = compare({"gpt2": Curve([0.0, 20.0], [3.0, 2.0], 20), "modern": c}, "gpt2", "modern")
    assert short["time_share"] is None and short["lower_at_equal_time"] is None
    assert short["too_few_evaluations"] == {"gpt2": 2}
    pace = {"median_gflops": 50.0, "min_gflops": 25.0}
    short["gpt2"]["host_pace"] = short["modern"]["host_pace"] = pace
    summary = {"recipes": {"gpt2": "", "modern": ""}, "seeds": [{**short, "seed": 0}], "median_time_share": None}
    summary.update(lower_at_equal_time_every_seed=False, too_few_evaluations={0: {"gpt2": 2}}, plot="p.png")
    summary["common_pace_gflops"] = 100.0
    printed = format_summary(summary)
    assert "no conclusion from seed 0: too few evaluations (gpt2 2; at least 3 a run)" in printed
    assert "0.50x 0.25x; 0.50x 0.25x" in printed and "common host pace, 100.0 GFLOP/s" in printed
    short["gpt2"]["host_pace"] = short["modern"]["host_pace"] = summary["common_pace_gflops"] = None  # GPU runs
    assert "n/a; n/a" in format_summary(summary) and "seconds as measured" in format_summary(summary)


def test_the_pace_meter_probes_a_cpu_run_after_its_optimizer_steps_and_leaves_a_gpu_run_alone(monkeypatch):
    monkeypatch.setattr(gptforge.speedrun, "PROBE_SHARE", math.inf)  # a probe after every step
    monkeypatch.setattr(gptforge.speedrun, "PROBE_EVERY", 0.0)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(2)
    with PaceMeter(torch.device("cpu")) as meter:
        optimizer.step()
    optimizer.step()  # the hook went with the block
    assert len(meter.probes) == 3 and all(p.gflops > 0 and p.seconds > 0 for p in meter.probes)  # entry, step, exit
    with PaceMeter(torch.device("cuda")) as meter:
        optimizer.step()
    assert meter.probes == []


def slowed(train_run, key, factor):
    """`_train_run` with the clocks the trainer and the probe read running `factor` times fast for the run `key`:
    a host `factor` times slower for that run alone, its steps and its probes alike."""

    def run(cfg, run_key, *args):
        if run_key != key:
            return train_run(cfg, run_key, *args)
        real = time.perf_counter
        origin = real()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(time, "perf_counter", lambda: origin + factor * (real() - origin))
            return train_run(cfg, run_key, *args)

    return run


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("speedrun")
    (root / "modern-tiny.toml").write_text(MODERN_TINY)
    recipes = {"gpt2": "tiny", "modern": str(root / "modern-tiny.toml")}
    seed = load_config("tiny").train.seed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gptforge.speedrun, "PROBE_EVERY", 0.02)  # probes between the steps of these short runs too
        # The second seed's modern run on a host 8x slower: the case of recipes timed minutes apart on a shared host.
        mp.setattr(gptforge.speedrun, "_train_run", slowed(gptforge.speedrun._train_run, ("modern", seed + 1), 8.0))
        # A budget no run reaches on a loaded machine: 24 steps each, so the curves do not depend on its speed.
        summary = speedrun(root / "out", 3600, 2, data_dir, recipes, ["train.max_steps=24"])
    return root, summary


def test_the_curve_leaves_out_the_first_step_which_pays_for_compilation(tmp_path):
    val = lambda step, bpb: {"kind": "val", "step": step, "loss": bpb, "ppl": 1.0, "bpb": bpb}  # noqa: E731
    train = dict(kind="train", loss=1.0, lr=1e-3, grad_norm=1.0, tokens=0, tokens_per_s=0.0, time=0.0)
    lines = [val(0, 5.0), {**train, "step": 1, "ms": 30_000.0}, {**train, "step": 2, "ms": 500.0}, val(2, 4.0)]
    lines += [{**train, "step": 3, "ms": 500.0}, val(3, 3.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    curve = read_curve(tmp_path)
    assert (curve.seconds, curve.bpb, curve.steps) == ([0.0, 0.5, 1.0], [5.0, 4.0, 3.0], 3)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    with pytest.raises(GptforgeError, match="1 optimizer step; time to quality needs 2 or more"):
        read_curve(tmp_path)  # a budget shorter than start-up and one step


def test_each_recipe_trains_for_the_budget_on_every_seed_and_the_result_is_written(run):
    root, summary = run
    seed = load_config("tiny").train.seed
    assert [r["seed"] for r in summary["seeds"]] == [seed, seed + 1]
    for r in summary["seeds"]:
        curves = {}
        for name in ("gpt2", "modern"):
            run_dir = root / "out" / f"{name}-seed{r['seed']}"
            assert f"seed = {r['seed']}\n" in (run_dir / "config.toml").read_text()
            curve = curves[name] = read_curve(run_dir)
            assert curve.seconds == sorted(curve.seconds) and len(curve.bpb) == 6  # 0, every 5, the end
            assert r[name]["final_bpb"] == curve.final and 0 < r[name]["seconds"] <= 3600 and r[name]["steps"] == 24
        # Reached exactly when some evaluation of the candidate is at or below the baseline's final bpb.
        reached = r["time_to_baseline_final"]
        assert (reached is not None) == (min(curves["modern"].bpb) <= curves["gpt2"].final)
        if reached is not None:
            assert 0 <= reached <= r["modern"]["seconds"]  # both at the runs' common pace
            assert r["time_share"] == pytest.approx(reached / r["gpt2"]["seconds"])
        assert compare(curves, "gpt2", "gpt2")["time_to_baseline_final"] is not None  # it reaches its own final
    saved = json.loads((root / "out" / "speedrun.json").read_text())
    assert saved["seeds"] == summary["seeds"] and saved["recipes"]["modern"].endswith("modern-tiny.toml")
    assert (root / "out" / "speedrun.png").read_bytes()[:4] == b"\x89PNG"
    assert "median time to gpt2's quality" in format_summary(summary)


def test_a_run_on_a_slowed_host_is_timed_at_the_common_pace(run):
    root, summary = run
    fast, slow = (r["modern"] for r in summary["seeds"])  # the second ran with every clock 8x fast
    wall, paced = slow["wall_seconds"] / fast["wall_seconds"], slow["seconds"] / fast["seconds"]
    assert wall > 2  # by its own clock: what skewed the comparison
    assert slow["host_pace"]["of_common"] < fast["host_pace"]["of_common"] / 2 and slow["host_pace"]["probes"] >= 2
    # At the common pace the same model's same 24 steps take about the same time: most of the 8x is gone.
    assert abs(math.log(paced)) < abs(math.log(wall)) / 2
    saved = json.loads((root / "out" / "speedrun.json").read_text())
    assert saved["seeds"][1]["modern"]["host_pace"] == slow["host_pace"] and saved["common_pace_gflops"] > 0


def write_run(folder, step_ms: list[float]) -> None:
    """A run's metrics: steps 1..N of `step_ms` ending at wall times 1, 2, ..., evaluations at 0, 2 and N."""
    val = lambda step: {"kind": "val", "step": step, "time": float(step), "loss": 1.0, "ppl": 1.0, "bpb": 5.0 - step}  # noqa: E731
    train = dict(kind="train", loss=1.0, lr=1e-3, grad_norm=1.0, tokens=0, tokens_per_s=0.0)
    lines = [val(0)]
    for step, ms in enumerate(step_ms, 1):
        lines += [{**train, "step": step, "time": float(step), "ms": ms}] + (
            [val(step)] if step in (2, len(step_ms)) else []
        )
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_step_times_are_put_at_the_common_pace_by_the_probe_beside_them(tmp_path):
    # The same steps twice; the second time the host ran at a third of the pace from step 3 on, and a probe of
    # 0.3 s (inside step 3's optimizer step, so inside its time) saw it.
    write_run(tmp_path / "idle", [30_000.0, 1000.0, 1000.0, 1000.0])
    write_run(tmp_path / "slowed", [30_000.0, 1000.0, 3300.0, 3000.0])
    idle = [Probe(0.5, 0.01, 100.0), Probe(4.5, 0.01, 100.0)]
    slowed = [Probe(0.5, 0.01, 100.0), Probe(2.5, 0.3, 100.0 / 3), Probe(4.5, 0.03, 100.0 / 3)]
    at_common = read_curve(tmp_path / "slowed", slowed, 100.0)
    assert at_common.seconds == pytest.approx(read_curve(tmp_path / "idle", idle, 100.0).seconds)
    assert at_common.seconds == pytest.approx([0.0, 1.0, 3.0]) and at_common.bpb == [5.0, 3.0, 1.0]
    assert read_curve(tmp_path / "slowed", slowed).seconds == pytest.approx([0.0, 1.0, 7.0])  # its own clock
    assert read_curve(tmp_path / "idle", idle, 50.0).seconds == pytest.approx([0.0, 2.0, 6.0])  # twice the pace


def test_an_existing_result_is_replaced_only_with_force(run, data_dir):
    root, _ = run
    with pytest.raises(GptforgeError, match="--force"):
        speedrun(root / "out", 3, 1, data_dir, {"gpt2": "tiny", "modern": "tiny"})
    with pytest.raises(GptforgeError, match="nowhere"):
        speedrun(root / "new", 3, 1, root / "nowhere", {"gpt2": "tiny", "modern": "tiny"})
    assert not (root / "new").exists()
    bad = subprocess.run(cli("speedrun", "--modern-config", "nope"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--modern-config nope: unknown preset" in bad.stderr
    bad = subprocess.run(cli("speedrun", "--budget", "0"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--budget: expected a number >= 1.0, got '0'" in bad.stderr
