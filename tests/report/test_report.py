"""Plots (checked for their panels, not pixels) and the markdown report."""

import json
import math

import pytest

from gptforge.cli import main
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.report.plot import PANELS, plot_runs
from gptforge.report.summary import run_report
from gptforge.train.trainer import train


def test_plot_overlays_runs_with_every_panel_and_report(data_dir, tmp_path, capsys):
    hellaswag = tmp_path / "h.jsonl"
    hellaswag.write_text(json.dumps({"ctx": "def f", "endings": ["(x):", "a", "b", "c"], "label": 0}) + "\n")
    for name, lr in (("a", "3e-3"), ("b", "1e-3")):
        cfg = load_config(
            "tiny",
            [
                f"data.path={data_dir}",
                "train.max_steps=4",
                "eval.every=2",
                f"optim.lr={lr}",
                f"eval.hellaswag={hellaswag}",
                "eval.code=2",
            ],
        )
        train(cfg, tmp_path / name)
    plot = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    out = plot.path
    assert plot.panels == list(PANELS) and "HellaSwag acc_norm_token" in plot.panels and "tokens/s" in plot.panels
    assert sum(a.startswith("code: exact match, parse rate: ") for a in plot.annotations) == 2 * 3  # not infilling
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The last evaluation's values are written on the panels, for each run.
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "val"][-1]
    assert f"val bits per byte: a {last['bpb']:.3f}" in plot.annotations
    assert sum(a.startswith("HellaSwag acc_norm_token: ") for a in plot.annotations) == 2
    # Without HellaSwag results there is no HellaSwag panel.
    train(load_config("tiny", [f"data.path={data_dir}", "train.max_steps=2"]), tmp_path / "c")
    bare = plot_runs([tmp_path / "c"])
    assert "HellaSwag acc_norm_token" not in bare.panels and len(bare.panels) == 5  # nor code measures
    from PIL import Image

    assert Image.open(out).size == (1600, 1275)  # 7 panels: 3 rows

    capsys.readouterr()
    assert main(["report", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    for row in ("| steps | 4 |", "| tokens seen | 1,024 |", "best val loss", "best HellaSwag acc_norm", "```toml"):
        assert row in text
    assert (tmp_path / "a" / "report.md").read_text() == text == run_report(tmp_path / "a")


def write_metrics(run, *records):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


TRAIN = {"kind": "train", "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "mfu": 0.1, "time": 0.0}


def test_plot_and_report_survive_a_diverged_step_and_a_torn_line_and_name_a_bad_one(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(
        run,
        {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8},
        {**TRAIN, "step": 2, "loss": None, "grad_norm": None, "tokens": 16},  # a diverged step, logged as null
        {"kind": "val", "step": 2, "loss": 2.5, "ppl": 12.2, "bpb": 1.1},
    )
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # torn by a crash mid-append
    assert main(["plot", str(run), "--out", str(tmp_path / "new" / "dir" / "curves.pdf")]) == 0
    assert (tmp_path / "new" / "dir" / "curves.pdf").read_bytes()[:5] == b"%PDF-"  # the format the name asks for
    assert main(["report", str(run)]) == 0
    assert "| best val loss | 2.5000 (step 2) |" in capsys.readouterr().out

    assert main(["plot", str(run), "--out", str(tmp_path / "x.nope")]) == 1
    assert "unknown image format 'nope'" in capsys.readouterr().err
    write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8}, {"kind": "train", "step": 2}, {"a": 1})
    for command in ("plot", "report"):
        assert main([command, str(run)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.endswith(
            "metrics.jsonl:2: a train record without ['loss', 'lr', 'grad_norm', 'tokens', "
            "'tokens_per_s', 'time'] (not written by gptforge train)"
        ), err


def test_plot_into_a_folder_is_refused_and_a_read_only_run_still_gets_its_report(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8})
    assert main(["plot", str(run), "--out", str(tmp_path)]) == 1
    assert "is a folder (expected an image file name" in capsys.readouterr().err

    import gptforge.report.summary

    def read_only(path, data):
        raise GptforgeError(f"cannot write {path}: Read-only file system")

    monkeypatch.setattr(gptforge.report.summary, "atomic_write", read_only)
    assert main(["report", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "| steps | 1 |" in out
    assert (
        err.strip()
        == f"gptforge report: warning: report.md not written: cannot write {run}/report.md: Read-only file system"
    )


def test_a_run_logged_with_the_old_acc_norm_name_still_plots_and_reports(tmp_path, capsys):
    """Runs written before HellaSwag's per-token accuracy was named acc_norm_token read as before."""
    run = tmp_path / "run"
    old = {"kind": "hellaswag", "acc": 0.25, "acc_norm": 0.375, "n": 8}
    write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8}, {**old, "step": 1}, {**old, "step": 2})
    assert main(["plot", str(run)]) == 0
    assert main(["report", str(run)]) == 0
    assert "| best HellaSwag acc_norm_token | 0.3750 (step 1, 8 examples) |" in capsys.readouterr().out


def test_a_run_whose_mfu_was_never_trustworthy_reports_it_as_not_available(tmp_path):
    run = tmp_path / "run"
    write_metrics(
        run,
        {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8, "mfu": None},
        {**TRAIN, "step": 2, "loss": 2.0, "tokens": 16, "mfu": None},  # a peak slowed by load logs null
    )
    assert "| mean MFU | n/a (no step had a trustworthy peak to compare with) |" in run_report(run)
    write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8}, {**TRAIN, "step": 2, "loss": 2.0, "tokens": 16})
    assert "| mean MFU | 10.0% |" in run_report(run)


def test_a_run_without_bits_per_byte_reports_them_as_not_available(tmp_path, capsys):
    """A run on a manifest-less llm.c folder, or a chat folder whose held-out replies are empty, logs bpb as null
    (NaN): the report's formatting raised a TypeError."""
    run = tmp_path / "run"
    write_metrics(
        run,
        {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8},
        {"kind": "val", "step": 1, "loss": 2.5, "ppl": 12.18, "bpb": None},
    )
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| best val bits/byte | n/a |" in out and "| best val perplexity | 12.18 |" in out


def test_odd_runs_are_one_line_or_a_report_still_printed(tmp_path, capsys, monkeypatch):
    """A null time or tokens and a config.toml that is not UTF-8 were tracebacks; a report.md that is a folder
    printed no report; `report .` titled it with an empty name."""
    run = tmp_path / "run"
    for bad in ({"time": None}, {"tokens": "12"}, {"loss": True}):
        write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8, **bad})
        assert main(["report", str(run)]) == 1
        err = capsys.readouterr().err
        assert (
            f"metrics.jsonl:1: a train record whose ['{next(iter(bad))}'] is not a number" in err
            and err.count("\n") == 1
        ), err
    write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8})
    (run / "config.toml").write_bytes(b"[model]\nname = '\xff'\n")
    assert main(["report", str(run)]) == 1
    assert capsys.readouterr().err == f"gptforge report: error: {run / 'config.toml'}: expected UTF-8 text\n"
    (run / "config.toml").unlink()
    (run / "report.md").mkdir()
    monkeypatch.chdir(run)
    assert main(["report", "."]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# Run `run`") and "report.md not written" in err and "Is a directory" in err


@pytest.mark.parametrize("kind", [[], {}])
def test_a_record_whose_kind_is_a_list_or_object_is_skipped(tmp_path, capsys, kind):
    """Such a kind is no kind a reader draws: looking it up raised a TypeError (unhashable) in report and plot."""
    run = tmp_path / "run"
    write_metrics(run, {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8}, {"kind": kind, "step": 2, "loss": 1.0})
    assert main(["plot", str(run)]) == 0
    assert main(["report", str(run)]) == 0
    assert "| steps | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("time", [math.nan, math.inf, -math.inf])
def test_a_time_that_is_not_finite_is_one_line_and_one_past_a_float_is_not_available(tmp_path, capsys, time):
    """Python's json reads NaN and Infinity (as json.dumps writes them): the wall time's int() raised a ValueError
    or OverflowError."""
    run = tmp_path / "run"
    write_metrics(
        run,
        {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8},
        {**TRAIN, "step": 2, "loss": 2.0, "tokens": 16, "time": time},
    )
    assert main(["report", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        "metrics.jsonl:2: a train record whose ['time'] is not a number (not written by gptforge train)\n"
    )
    assert err.count("\n") == 1
    write_metrics(
        run,
        {**TRAIN, "step": 1, "loss": 3.0, "tokens": 8, "time": -1e308},
        {**TRAIN, "step": 2, "loss": 2.0, "tokens": 16, "time": 1e308},  # each finite, their difference is not
    )
    assert "| wall time (train records) | n/a |" in run_report(run)


@pytest.mark.parametrize(
    "key,values",
    [
        ("step", [1, 2, 10**30]),  # past int64: numpy made an object array, which np.interp refused
        ("step", [1, 2, 10**400]),  # past a float
        ("tokens", [8, 16, 1e308]),  # the tokens axis ran to infinity
        ("tokens", [-1e308, 16, 24]),
        ("loss", [-1e308, 2.0, 1e308]),  # the loss panel's ticks overflowed
        ("tokens_per_s", [10.0, 10.0, 10**400]),
    ],
)
def test_plot_leaves_out_values_too_large_to_draw(tmp_path, capsys, key, values):
    run = tmp_path / "run"
    steps = [{**TRAIN, "step": i, "loss": 3.0 - i, "tokens": 8 * i} for i in (1, 2, 3)]
    write_metrics(
        run,
        *({**record, key: value} for record, value in zip(steps, values, strict=True)),
        {"kind": "val", "step": 2, "loss": 2.5, "ppl": 12.2, "bpb": 1.1},
    )
    assert main(["plot", str(run)]) == 0, capsys.readouterr().err
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(run)]) == 0


@pytest.mark.parametrize("step", [True, 1.0, "1", None])
def test_a_step_that_is_not_an_integer_is_one_line(tmp_path, step):
    """`"step": true` was read as step 1 (JSON's true is Python's 1)."""
    from gptforge.rundir import read_metrics

    row = {"kind": "val", "step": step, "loss": 1.0, "ppl": 2.7, "bpb": 1.0, "tokens": 1}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(GptforgeError, match=r"metrics\.jsonl:1: expected a JSON object with an integer 'step'"):
        read_metrics(tmp_path)
