"""Plots (checked for their panels, not pixels) and the markdown report."""

import json

from gptforge.cli import main
from gptforge.config import load_config
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
            ],
        )
        train(cfg, tmp_path / name)
    out, panels = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    assert panels == list(PANELS) and "HellaSwag acc_norm" in panels and "tokens/s" in panels
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(out).size == (1600, 850)

    capsys.readouterr()
    assert main(["report", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    for row in ("| steps | 4 |", "| tokens seen | 1,024 |", "best val loss", "best HellaSwag acc_norm", "```toml"):
        assert row in text
    assert (tmp_path / "a" / "report.md").read_text() == text == run_report(tmp_path / "a")
