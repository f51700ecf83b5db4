"""An RL run's curves and report: `gptforge plot` draws a `gptforge rl` folder with its own panels."""

import json

import pytest

from gptforge.cli import main
from gptforge.errors import GptforgeError
from gptforge.report.rl_plot import PANELS, is_rl_run, plot_rl


def write_rl_run(run, steps=6):
    rows = []
    for step in range(1, steps + 1):
        rows.append({"kind": "rl", "step": step, "time": step * 2.0, "reward": step / 10, "pass_rate": step / 20,
                     "reply_tokens": 30 - step, "kl": step / 100, "clipped": 0.0, "sample_s": 1.0, "score_s": 0.5,
                     "update_s": 0.7})  # fmt: skip
        if step % 3 == 0:
            rows.append({"kind": "tasks", "step": step, "pass@1": step / 30, "tasks": 70, "parses": 0.9})
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_an_rl_run_is_drawn_with_its_held_out_pass_at_1(tmp_path, capsys):
    run = write_rl_run(tmp_path / "rl")
    plot = plot_rl(run)
    assert plot.path == run / "rl.png" and plot.path.stat().st_size > 10_000
    assert plot.panels == list(PANELS) and plot.annotations == ["reward and pass rate: held-out pass@1 20.0%"]
    assert is_rl_run(run) and main(["plot", str(run), "--out", str(tmp_path / "p.png")]) == 0
    assert f"wrote {tmp_path / 'p.png'}" in capsys.readouterr().out


def test_a_folder_without_rl_records_is_not_an_rl_run(tmp_path):
    (tmp_path / "empty").mkdir()
    assert not is_rl_run(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "tasks", "step": 0, "pass@1": 0.1, "tasks": 7}\n')
    assert not is_rl_run(tmp_path / "empty")
    with pytest.raises(GptforgeError, match="no rl records to plot"):
        plot_rl(tmp_path / "empty")


def test_the_report_of_an_rl_run_gives_its_steps_reward_and_held_out_pass_at_1(tmp_path):
    from gptforge.report.summary import run_report

    text = run_report(write_rl_run(tmp_path / "rl", steps=12))
    assert "| RL steps | 12 |" in text
    assert "| mean reward, share solved (last 10 steps) | 0.750, 0.375 |" in text  # steps 3-12: mean 7.5 / 10, / 20
    assert "| held-out pass@1 (70 tasks) | 10.0% at step 3, 40.0% at step 12 |" in text
