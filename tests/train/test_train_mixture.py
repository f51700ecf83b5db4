"""Training on a mix of two prepared folders: per-folder epochs and validation in metrics.jsonl, the plot, the report
and the page; the refusals before training; exact resume; 2 gloo processes == 1 process with double accumulation."""

import json
import math
import os
import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from tests.helpers import cli, losses, weights

from gptforge.config import load_config
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.errors import GptforgeError
from gptforge.report.summary import run_report
from gptforge.train.trainer import train

WORDS = (  # split in the fixture
    "river stone light garden window paper music winter market letter forest engine silver orange doctor island "
    "yellow camera bridge pocket rabbit thunder candle planet violin ladder harbor mirror pillow saddle basket "
    "castle meadow lantern pepper kettle blanket falcon timber velvet marble copper shadow feather canyon orchard"
)


@pytest.fixture(scope="module")
def folders(data_dir, tmp_path_factory):
    """ROOT/code (the session's code corpus, linked) and ROOT/prose (random English words), both gpt2-tokenized."""
    root = tmp_path_factory.mktemp("mix")
    (root / "code").symlink_to(data_dir)
    corpus = root / "prose-corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(40):
        sentences = [" ".join(rng.choices(WORDS.split(), k=12)).capitalize() + "." for _ in range(15)]
        (corpus / f"page_{i:03d}.txt").write_text(" ".join(sentences) + "\n")
    prepare(PrepareSettings.from_flags(str(corpus), val_fraction=0.2, shard_tokens=2000), root / "prose", workers=1)
    return root


def mix_cfg(root, *overrides, mix="code=0.7,prose=0.3"):
    spec = ",".join(f"{root / item.split('=')[0]}={item.split('=')[1]}" for item in mix.split(","))
    return load_config("tiny", [f"data.mix={spec}", "eval.sample_tokens=0", *overrides])


def records(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_a_mix_trains_logging_each_folders_epochs_and_validation(folders, tmp_path, capsys, monkeypatch):
    result = train(mix_cfg(folders, "train.max_steps=6", "eval.every=3"), tmp_path / "run")
    out = capsys.readouterr().out
    assert "data: a mix of 2 folders over the planned 1,536 tokens" in out  # 6 steps x 256 tokens
    assert "  code   70.0% |" in out and "  prose  30.0% |" in out and " epochs of " in out

    train_records = records(tmp_path / "run", "train")
    epochs = [(r["epoch/code"], r["epoch/prose"]) for r in train_records]
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(epochs, epochs[1:], strict=False))
    vals = records(tmp_path / "run", "val")
    assert [v["step"] for v in vals] == [0, 3, 6]
    for v in vals:
        # The mix's loss is the folders' weighted by the mix; its bpb, those bits over the bytes they cover.
        assert v["loss"] == pytest.approx(0.7 * v["loss/code"] + 0.3 * v["loss/prose"], rel=1e-12)
        per_byte = {n: v[f"loss/{n}"] / math.log(2) / v[f"bpb/{n}"] for n in ("code", "prose")}
        bits = 0.7 * v["loss/code"] / math.log(2) + 0.3 * v["loss/prose"] / math.log(2)
        assert v["bpb"] == pytest.approx(bits / (0.7 * per_byte["code"] + 0.3 * per_byte["prose"]), rel=1e-9)
    assert vals[-1]["loss/prose"] < vals[0]["loss/prose"] and vals[-1]["loss/code"] < vals[0]["loss/code"]
    assert result.last_val == {k: v for k, v in vals[-1].items() if k not in ("kind", "step", "time")}
    config = (tmp_path / "run" / "config.toml").read_text()
    assert f'mix = ["{folders / "code"}=0.7", "{folders / "prose"}=0.3"]' in config

    report = run_report(tmp_path / "run")
    assert f"| final val loss / bits per byte: prose | {vals[-1]['loss/prose']:.4f} / " in report

    import matplotlib.axes

    from gptforge.report.plot import plot_runs

    labels, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda ax, *a, **k: labels.append(k.get("label")) or plot(ax, *a, **k)
    )
    plot_runs([tmp_path / "run"])
    assert {"run val code", "run val prose", "run code", "run prose"} <= set(labels)


def test_the_page_draws_each_folders_val_curves(folders, tmp_path):
    testclient = pytest.importorskip("starlette.testclient")
    from gptforge.serve.app import build_app

    train(mix_cfg(folders, "train.max_steps=2", "eval.every=1"), tmp_path / "runs" / "mixed")
    val = testclient.TestClient(build_app(tmp_path / "runs")).get("/api/runs/mixed/metrics").json()["val"]
    assert val["step"] == [0, 1, 2] and len(val["loss/code"]) == len(val["bpb/prose"]) == 3

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        pytest.skip("no Chromium on this machine (.ci/run installs it)")
    from tests.serve.server import serving

    with serving(tmp_path / "runs") as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("#chart-bpb .u-legend", timeout=60_000)
        loss, bpb = page.inner_text("#chart-loss .u-legend"), page.inner_text("#chart-bpb .u-legend")
        browser.close()
    assert all(f"mixed val {name}" in loss and f"mixed val {name}" in bpb for name in ("code", "prose"))


def test_a_bad_mix_is_refused_before_training_starts_naming_the_folder(folders, tmp_path):
    other = tmp_path / "other"
    prepare(
        PrepareSettings.from_flags(str(folders / "prose-corpus"), train_tokenizer=300, val_fraction=0.2),
        other,
        workers=1,
    )
    cases = {
        "code=0.7,nowhere=0.3": r"^data.mix: \S*nowhere: no manifest.json",
        "code=0.7,other=0.3": r"^data.mix: \S*other was prepared with tokenizer tokenizer.json \(300 tokens, eot 0\)",
    }
    (folders / "other").symlink_to(other)
    for mix, message in cases.items():
        with pytest.raises(GptforgeError, match=message):
            train(mix_cfg(folders, mix=mix), tmp_path / "run")
        assert not (tmp_path / "run").exists()
    with pytest.raises(GptforgeError, match="has weight '0' "):
        mix_cfg(folders, mix="code=0.7,prose=0")


def test_resume_with_a_mix_is_exact_and_a_changed_mix_is_said(folders, tmp_path):
    cfg = mix_cfg(folders, "train.max_steps=8", "checkpoint.every=4", "eval.every=4", "model.dropout=0.1")
    straight = train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000008")
    resumed = train(cfg, tmp_path / "b", resume="auto")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # the resumed steps 5-8 bitwise
    assert losses(tmp_path / "a", "val") == losses(tmp_path / "b", "val")
    a, b = weights(straight.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(a[name], b[name]) for name in a)
    last_a, last_b = records(tmp_path / "a", "train")[-1], records(tmp_path / "b", "train")[-1]
    assert [last_a[k] for k in ("epoch/code", "epoch/prose")] == [last_b[k] for k in ("epoch/code", "epoch/prose")]

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000008")
    changed = mix_cfg(folders, "train.max_steps=8", "checkpoint.every=4", mix="code=0.5,prose=0.5")
    train(changed, tmp_path / "b", resume="auto")
    code, prose = folders / "code", folders / "prose"
    before, after = [f"{code}=0.7", f"{prose}=0.3"], [f"{code}=0.5", f"{prose}=0.5"]
    changes = records(tmp_path / "b", "resume")[-1]["changes"]
    assert [c for c in changes if c.startswith("data.mix")] == [f"data.mix: {before!r} -> {after!r}"]

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000008")  # a folder dropped is a change of the mix alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it once warned that code's shards differed
        train(mix_cfg(folders, "train.max_steps=8", "checkpoint.every=4", mix="code=1"), tmp_path / "b", resume="auto")


@pytest.mark.slow
def test_two_gloo_processes_on_a_mix_match_one_process_with_double_accumulation(folders, tmp_path):
    spec = f"data.mix={folders / 'code'}=0.7,{folders / 'prose'}=0.3"
    common = ["--config", "tiny", "--set", spec, "--set", "train.max_steps=4", "--set", "eval.every=2"]
    common += ["--set", "eval.sample_tokens=0", "--set", "train.batch_tokens=512"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    two = subprocess.run(
        [*launcher, "gptforge", "train", *common, "--out", str(tmp_path / "two")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(cli("train", *common, "--out", tmp_path / "one"), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "2 processes x 2 accumulation" in two.stdout and "1 process x 4 accumulation" in one.stdout
    for kind in ("train", "val"):
        a, b = records(tmp_path / "one", kind), records(tmp_path / "two", kind)
        keys = [k for k in a[0] if k.startswith(("loss", "bpb", "epoch"))]
        assert len(a) == len(b) and len(keys) >= (5 if kind == "val" else 3)
        for ra, rb in zip(a, b, strict=True):
            assert all(abs(ra[k] - rb[k]) <= 1e-5 for k in keys), (kind, ra, rb)
