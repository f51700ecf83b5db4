"""`gptforge plot`: one PNG of a run's curves, or several runs overlaid for comparison.

Panels: loss (train smoothed, val), val bits per byte, HellaSwag acc_norm_token (per-token mean, when evaluated) with
the GPT-2 / GPT-3 124M reference lines, the code measures (when evaluated: infilling exact match of hidden lines and
spans, with the suffix and from the prefix alone, and the parse rate of sampled bodies), learning rate, gradient
norm, tokens/s; steps below, tokens above. A run on
a mix adds each folder's val loss and bits per byte (dotted, one marker per folder) beside the mix's.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.eval.hellaswag import GPT2_124M_ACC_NORM, GPT3_125M_ACC_NORM
from gptforge.files import atomic_write
from gptforge.inputs import printable
from gptforge.rundir import finite_number, read_metrics, val_sources

SOURCE_MARKERS = "s^vDPX*"
DRAWABLE = 1e300  # the largest magnitude drawn: matplotlib's margins and ticks overflow near a float's 1.8e308
HELLASWAG = "HellaSwag acc_norm_token"
CODE = "code: exact match, parse rate"
PANELS = ("loss", "val bits per byte", HELLASWAG, CODE, "learning rate", "grad norm (pre-clip)", "tokens/s")
OPTIONAL = {HELLASWAG: "hellaswag", CODE: "code"}  # drawn when a run has records of that kind
CODE_CURVES = (  # key, label, line style
    ("infill_exact", "infill, 1 line", "o-"),
    ("prefix_exact", "prefix only, 1 line", "o--"),
    ("span_infill_exact", "infill, 3 lines", "s-"),
    ("span_prefix_exact", "prefix only, 3 lines", "s--"),
    ("parse_rate", "bodies that parse", "^:"),
)


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard-style)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Steps and values of `key` that an axis can hold (a diverged step logs null; a hand-edited line may lack the
    key, or hold a number too large to draw)."""
    pairs = [(r["step"], r.get(key)) for r in records]
    kept = [(float(s), float(v)) for s, v in pairs if _drawable(s) and _drawable(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def _drawable(value: object) -> bool:
    """A finite number no larger than DRAWABLE either way."""
    return finite_number(value) and abs(value) <= DRAWABLE


def _records(run_dir: Path) -> dict[str, list[dict]]:
    by_kind = read_metrics(run_dir)
    if not by_kind["train"] and not by_kind["val"]:
        raise GptforgeError(f"{run_dir / 'metrics.jsonl'}: no train or val records to plot")
    return by_kind


@dataclass
class Plot:
    """What `plot_runs` drew: the image, its panels' titles and the final values written on them."""

    path: Path
    panels: list[str]
    annotations: list[str] = field(default_factory=list)


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Plot:
    """Write the PNG (default: the first run's loss.png). The HellaSwag and code panels are drawn when a run has
    such results; a tokens axis (the first run's) tops each panel; the last evaluation's values are written on it."""
    runs = [(Path(d), _records(Path(d))) for d in run_dirs]
    panels = [p for p in PANELS if p not in OPTIONAL or any(rec[OPTIONAL[p]] for _, rec in runs)]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(panels) // 3)
    fig, grid = plt.subplots(rows, 3, figsize=(16, 4.25 * rows))
    for unused in grid.flat[len(panels) :]:
        fig.delaxes(unused)
    ax = dict(zip(panels, grid.flat, strict=False))
    plot = Plot(Path(out) if out else runs[0][0] / "loss.png", panels)
    for i, (run_dir, rec) in enumerate(runs):
        _draw_run(ax, rec, color=f"C{i}", name=printable(run_dir.name), plot=plot)
    if HELLASWAG in ax:
        refs = ax[HELLASWAG]
        refs.axhline(GPT2_124M_ACC_NORM, color="gray", linestyle="--", label=f"GPT-2 124M ({GPT2_124M_ACC_NORM:.2%})")
        refs.axhline(GPT3_125M_ACC_NORM, color="black", linestyle=":", label=f"GPT-3 125M ({GPT3_125M_ACC_NORM:.1%})")
        refs.axhline(0.25, color="lightgray", linewidth=0.8, label="chance (25%)")
    to_tokens = _tokens_axis(runs[0][1]["train"])
    for title, a in ax.items():
        a.set_title(title)
        a.set_xlabel("step")
        if to_tokens is not None:
            a.secondary_xaxis("top", functions=to_tokens).set_xlabel(
                f"tokens ({printable(runs[0][0].name)})", fontsize=7
            )
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # a code panel whose records are all null has no curve
            a.legend(fontsize=7)
    ax["loss"].set_ylabel("cross-entropy (nats/token)")
    fig.suptitle(" vs ".join(printable(d.name) for d, _ in runs))
    fig.tight_layout()
    save_figure(fig, plot.path)
    plt.close(fig)
    return plot


def _draw_run(ax: dict, rec: dict[str, list[dict]], color: str, name: str, plot: Plot) -> None:
    """One run's curves on every panel, its final validation values written beside their last points."""
    train, val, hs = rec["train"], rec["val"], rec["hellaswag"]
    for panel, key in (("learning rate", "lr"), ("grad norm (pre-clip)", "grad_norm"), ("tokens/s", "tokens_per_s")):
        steps, values = series(train, key)
        ax[panel].plot(steps, values if key == "lr" else smooth(values), color=color, label=name)
    steps, losses = series(train, "loss")
    ax["loss"].plot(steps, losses, color=color, alpha=0.2, linewidth=0.7)
    ax["loss"].plot(steps, smooth(losses), color=color, label=f"{name} train (smoothed)")
    finals = [
        ("loss", series(val, "loss"), f"{name} val", "{:.3f}"),
        ("val bits per byte", series(val, "bpb"), name, "{:.3f}"),
    ]
    if HELLASWAG in ax:
        finals.append((HELLASWAG, series(hs, "acc_norm_token"), name, "{:.2%}"))
    if CODE in ax:
        finals += [(CODE, series(rec["code"], key), f"{name} {label}", "{:.0%}") for key, label, _ in CODE_CURVES]
    styles = {f"{name} {label}": style for _, label, style in CODE_CURVES}
    for panel, (steps, values), label, fmt in finals:
        if panel == CODE and not values:  # a model without FIM has no infilling curves
            continue
        style = styles.get(label, "o--" if panel == "loss" else "o-")
        ax[panel].plot(steps, values, style, color=color, markersize=3, label=label)
        if values:
            text = fmt.format(values[-1])
            ax[panel].annotate(text, (steps[-1], values[-1]), xytext=(4, 4), textcoords="offset points", color=color)
            plot.annotations.append(f"{panel}: {label} {text}")
    for j, source in enumerate(val_sources(val)):
        style = {"color": color, "linestyle": ":", "marker": SOURCE_MARKERS[j % len(SOURCE_MARKERS)], "markersize": 3}
        ax["loss"].plot(*series(val, f"loss/{source}"), **style, label=f"{name} val {source}")
        ax["val bits per byte"].plot(*series(val, f"bpb/{source}"), **style, label=f"{name} {source}")


def _tokens_axis(train: list[dict]) -> tuple | None:
    """Step <-> tokens for a secondary axis, from a run's train records (a batch ramp makes it non-linear)."""
    steps, tokens = series(train, "tokens")
    rising = all(b > a for xs in (steps, tokens) for a, b in zip(xs, xs[1:], strict=False))
    if len(steps) < 2 or not rising:
        return None
    import numpy as np

    # Straight on past the ends at the last rate, so the axis margins get ticks too.
    first, last, far = (
        (tokens[1] - tokens[0]) / (steps[1] - steps[0]),
        (tokens[-1] - tokens[-2]) / (steps[-1] - steps[-2]),
        1e12,
    )
    xs = np.array([steps[0] - far, *steps, steps[-1] + far])
    ys = np.array([tokens[0] - far * first, *tokens, tokens[-1] + far * last])
    if not (np.isfinite(ys).all() and np.abs(ys).max() <= DRAWABLE):  # token counts so large the ends overflow
        return None
    return (lambda s: np.interp(s, xs, ys)), (lambda t: np.interp(t, ys, xs))


def save_figure(fig, out: Path) -> None:
    if out.is_dir():
        raise GptforgeError(f"--out {out}: is a folder (expected an image file name such as loss.png)")
    kind = out.suffix[1:].lower() or "png"
    if kind not in fig.canvas.get_supported_filetypes():
        raise GptforgeError(f"--out {out}: unknown image format {kind!r} (expected .png, .pdf, .svg, ...)")
    image = io.BytesIO()
    fig.savefig(image, format=kind, dpi=100)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, image.getvalue())
