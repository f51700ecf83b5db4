"""An RL run's curves (`gptforge rl`, the chat demo's last stage): reward and share solved per step (smoothed) with
held-out pass@1, reply length, KL to the start and the share of tokens clipped, and each step's seconds split
into sampling, scoring and the update."""

from __future__ import annotations

from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.files import METRICS
from gptforge.inputs import printable
from gptforge.report.plot import Plot, save_figure, series, smooth
from gptforge.rundir import read_metrics

PANELS = ("reward and pass rate", "reply length (tokens)", "KL to the start, share clipped", "seconds a step")
TIMES = (("sample_s", "sampling"), ("score_s", "scoring"), ("update_s", "update"))


def plot_rl(run_dir: str | Path, out: str | Path | None = None) -> Plot:
    """Write RUN_DIR/rl.png (or `out`); the last held-out pass@1 is written on its panel."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir, ("rl", "tasks"))
    steps = records["rl"]
    if not steps:
        raise GptforgeError(f"{run_dir / METRICS}: no rl records to plot (expected a run of `gptforge rl`)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(1, 4, figsize=(20, 4.25))
    ax = dict(zip(PANELS, grid.flat, strict=True))
    plot = Plot(Path(out) if out else run_dir / "rl.png", list(PANELS))
    for key, label in (("reward", "reward"), ("pass_rate", "solved (training tasks)")):
        x, y = series(steps, key)
        ax[PANELS[0]].plot(x, smooth(y), label=f"{label}, smoothed")
    x, y = series(records["tasks"], "pass@1")
    if y:
        ax[PANELS[0]].plot(x, y, "o-", color="black", markersize=3, label="held-out pass@1")
        text = f"{y[-1]:.1%}"
        ax[PANELS[0]].annotate(text, (x[-1], y[-1]), xytext=(4, 4), textcoords="offset points")
        plot.annotations.append(f"{PANELS[0]}: held-out pass@1 {text}")
    ax[PANELS[1]].plot(*_smoothed(steps, "reply_tokens"), label="mean reply length")
    ax[PANELS[2]].plot(*_smoothed(steps, "kl"), label="KL (k3)")
    ax[PANELS[2]].plot(*_smoothed(steps, "clipped"), label="share clipped")
    x, _ = series(steps, "sample_s")
    parts = [series(steps, key)[1] for key, _ in TIMES]
    if all(len(p) == len(x) for p in parts):
        ax[PANELS[3]].stackplot(x, *parts, labels=[label for _, label in TIMES], alpha=0.8)
    for title, a in ax.items():
        a.set_title(title)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.suptitle(printable(run_dir.name))
    fig.tight_layout()
    save_figure(fig, plot.path)
    plt.close(fig)
    return plot


def is_rl_run(run_dir: str | Path) -> bool:
    """A folder `gptforge rl` wrote: rl records and no pretraining ones (`gptforge plot` draws it with plot_rl)."""
    try:
        records = read_metrics(run_dir, ("rl", "train"))
    except GptforgeError:
        return False
    return bool(records["rl"]) and not records["train"]


def _smoothed(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    x, y = series(records, key)
    return x, smooth(y)
