"""The promises table (docs/promises.md, linked from the README) names tests that exist, so it cannot drift from the
suite."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_test_the_promises_table_names_exists():
    assert "docs/promises.md" in (ROOT / "README.md").read_text()
    table = (ROOT / "docs" / "promises.md").read_text()
    named_tests = set(re.findall(r"`(test_\w+)`", table))
    named_files = set(re.findall(r"`(tests/[\w/]+\.py)`", table))
    assert len(named_tests) >= 20 and named_files
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.MULTILINE))
    assert named_tests - defined == set()
    assert {f for f in named_files if not (ROOT / f).is_file()} == set()


def test_the_demo_data_figures_are_the_recorded_runs():
    """README's figures about the demo's data drifted from what a run prints (60 files removed against the report's
    19 + 51 = 70; "8.5M training tokens, 186K validation" against 8,285,563 and 174,293; 7,241 requests against
    7,552 rows): they are quoted from one recorded run, `benchmarks/demo_data.py`'s."""
    import json

    record = json.loads(sorted((ROOT / "benchmarks").glob("demo-data-*.json"))[-1].read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())  # line breaks as spaces
    assert record["copies"] == record["exact_copies"] + record["near_copies"]
    quoted = [
        f"on Python {record['python']}, {record['files']:,} files, {record['megabytes']} MB",
        f"{record['copies']} files: {record['exact_copies']} exact and {record['near_copies']} near copies, "
        f"{record['copies_share_of_bytes']:.1%} of the bytes",
        f"{record['train_tokens']:,} training tokens, {record['val_tokens']:,} validation tokens",
        f"{record['requests']:,} requests, {record['training_conversations']:,} of them training conversations",
    ]
    assert [q for q in quoted if q not in readme] == []


def test_the_decode_figures_are_the_recorded_run():
    """The engine's speed against llama.cpp and transformers is quoted from `benchmarks/decode.py`'s recorded run."""
    import json

    path = sorted((ROOT / "benchmarks").glob("decode-cpu-*.json"))[-1]
    record = json.loads(path.read_text())["results"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    one, rows, long = "prompt 13, batch 1", "prompt 13, batch 32", "prompt 128, batch 1"
    speed = lambda name, case=one: record[name][case]["tokens_per_s"]  # noqa: E731
    fast, llama, served = speed("gptforge int8 compiled"), speed("llama.cpp f32"), speed("serve int8 compiled")
    quoted = [
        f"[recorded](benchmarks/{path.name})",
        f"float weights **{speed('gptforge'):,.1f} tokens/s**",
        f"(int8 weights, the step compiled) **{fast:,.1f} tokens/s**, against llama.cpp's {llama:,.1f}",
        f"f32 GGUF ({fast / llama:.2f}×; {speed('llama.cpp q8_0'):,.1f} on q8_0)",
        f"`transformers`' {speed('transformers'):,.1f}",
        f"one streamed request at a time) {served:,.1f} tokens/s ({served / llama:.2f}×)",
        f"32 rows together {speed('gptforge', rows):,.1f} tokens/s float, {speed('gptforge int8 compiled', rows):,.1f}",
        f"After a 128-token prompt: {speed('gptforge int8 compiled', long) / speed('llama.cpp f32', long):.2f}× in "
        f"process, {speed('serve int8 compiled', long) / speed('llama.cpp f32', long):.2f}× through `serve`",
    ]
    assert [q for q in quoted if q not in readme] == []


def test_the_rl_figures_are_the_recorded_runs():
    """Held-out pass@1 before and after RL, and an RL step's time split, are quoted from `benchmarks/rl_demo.py`'s
    recorded runs."""
    import json

    record = json.loads(sorted((ROOT / "benchmarks").glob("rl-demo-cpu-*.json"))[-1].read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    first, second = record["runs"]
    percent = lambda run, stage: f"{run['pass@1'][stage]:.1%}"  # noqa: E731
    gains = [100 * (run["pass@1"]["rl"] - run["pass@1"]["sft"]) for run in record["runs"]]
    ratios = [run["pass@1"]["rl"] / run["pass@1"]["sft"] for run in record["runs"]]
    curve = [point["pass@1"] for point in first["held_out_curve"][1:]]  # after step 0, the fine-tuned model
    later = [point["pass@1"] for point in second["held_out_curve"][1:]]
    quoted = [
        f"| base (each request as comments) | {record['base']['pass@1']:.1%} | {record['base']['pass@1']:.1%} |",
        f"| after fine-tuning | {percent(first, 'sft')} | {percent(second, 'sft')} |",
        f"| after RL | **{percent(first, 'rl')}** | **{percent(second, 'rl')}** |",
        f"from {percent(first, 'sft')} and {percent(second, 'sft')} after fine-tuning to {percent(first, 'rl')} and "
        f"{percent(second, 'rl')} after RL",
        f"answers {percent(first, 'rl')} and {percent(second, 'rl')} of held-out requests correctly",
        f"RL added {gains[0]:.1f} and {gains[1]:.1f} points ({ratios[0]:.2f}× and {ratios[1]:.2f}×)",
        f"{first['rl_seconds']:.0f} s and {second['rl_seconds']:.0f} s with an evaluation every 10 steps)",
        f"seed 1338's between {min(later):.1%} and {max(later):.1%}",
        f"moved between {min(curve):.1%} and {max(curve):.1%}",
        f"An RL step took {first['rl_step_seconds']['sample_s']:.2f} s sampling 56 replies",
        f"{first['rl_step_seconds']['score_s']:.2f} s scoring them",
        f"{first['rl_step_seconds']['update_s']:.2f} s for the update",
        f"matmul peaks {record['matmul_gflops']['fp32']} GFLOP/s fp32, {record['matmul_gflops']['bf16']} bf16",
    ]
    from gptforge.demo import DRILL_TASKS, TRAINING_TASKS  # the recorded run's data is the demo's

    quoted.append(f"{TRAINING_TASKS:,} built-in training tasks and {DRILL_TASKS:,} drills")
    before = json.loads((ROOT / "benchmarks" / "rl-demo-cpu-2026-11-27.json").read_text())["runs"]  # no drills
    gained = " and ".join(f"{100 * (r['pass@1']['rl'] - r['pass@1']['sft']):+.1f}" for r in before)
    quoted.append(
        f"without them, fine-tuning reached {percent(before[0], 'sft')} and {percent(before[1], 'sft')} and RL "
        f"{percent(before[0], 'rl')} and {percent(before[1], 'rl')} ({gained} points"
    )
    assert [q for q in quoted if q not in readme] == []
