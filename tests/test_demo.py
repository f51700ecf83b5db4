"""`gptforge demo` end to end on the real stdlib corpus, with a tiny model and a seconds-long budget."""

import json

import pytest

from gptforge.cli import main


@pytest.mark.slow
def test_demo_prepares_trains_reports_and_plots(tmp_path, capsys):
    out, data = tmp_path / "run", tmp_path / "data"
    tiny = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=64",
        "train.micro_batch=8",
        "train.batch_tokens=512",
        "eval.every=0",
        "eval.tokens=2048",
        "train.max_steps=60",  # a step count, not a time budget: the test must not depend on machine load
    ]
    args = ["demo", "--out", str(out), "--data", str(data)]
    assert main(args + [a for kv in tiny for a in ("--set", kv)]) == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed and "def fibonacci(n):" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"]["loss"] < summary["before"]["loss"] - 1.0
    assert summary["after"]["ppl"] < summary["before"]["ppl"]
    assert len(summary["completions"]) == 3
    for name in ("metrics.jsonl", "loss.png", "config.toml"):
        assert (out / name).is_file()
    assert (data / "tokenizer.json").is_file()
    assert json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"] == 8192

    # A second demo reuses the prepared corpus and replaces the earlier run.
    assert main(args + [a for kv in tiny for a in ("--set", kv)]) == 0
    assert "already prepared" in capsys.readouterr().out
