"""`gptforge speedrun`: both recipes on one corpus, budget and seeds; time to quality read from the curves."""

import json
import subprocess

import pytest
from tests.helpers import cli

from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.speedrun import Curve, compare, format_summary, read_curve, speedrun

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
    assert result["lower_at_equal_time"] and result["modern"]["final_bpb"] == 1.0
    # Two evaluations locate no crossing: no time share, no verdict, and the count is said.
    short = compare({"gpt2": Curve([0.0, 20.0], [3.0, 2.0], 20), "modern": c}, "gpt2", "modern")
    assert short["time_share"] is None and short["lower_at_equal_time"] is None
    assert short["too_few_evaluations"] == {"gpt2": 2}
    summary = {"recipes": {"gpt2": "", "modern": ""}, "seeds": [{**short, "seed": 0}], "median_time_share": None}
    summary.update(lower_at_equal_time_every_seed=False, too_few_evaluations={0: {"gpt2": 2}}, plot="p.png")
    assert "no conclusion from seed 0: too few evaluations (gpt2 2; at least 3 a run)" in format_summary(summary)


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("speedrun")
    (root / "modern-tiny.toml").write_text(MODERN_TINY)
    recipes = {"gpt2": "tiny", "modern": str(root / "modern-tiny.toml")}
    # A budget no run reaches on a loaded machine: 24 steps each, so the curves do not depend on its speed.
    summary = speedrun(root / "out", 600, 2, data_dir, recipes, ["train.max_steps=24"])
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
            assert r[name]["final_bpb"] == curve.final and 0 < r[name]["seconds"] <= 600 and r[name]["steps"] == 24
        # Reached exactly when some evaluation of the candidate is at or below the baseline's final bpb.
        reached = r["time_to_baseline_final"]
        assert (reached is not None) == (min(curves["modern"].bpb) <= curves["gpt2"].final)
        if reached is not None:
            assert 0 <= reached <= curves["modern"].seconds[-1]
            assert r["time_share"] == pytest.approx(reached / r["gpt2"]["seconds"])
        assert compare(curves, "gpt2", "gpt2")["time_to_baseline_final"] is not None  # it reaches its own final
    saved = json.loads((root / "out" / "speedrun.json").read_text())
    assert saved["seeds"] == summary["seeds"] and saved["recipes"]["modern"].endswith("modern-tiny.toml")
    assert (root / "out" / "speedrun.png").read_bytes()[:4] == b"\x89PNG"
    assert "median time to gpt2's quality" in format_summary(summary)


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
