"""`gptforge plot`: one PNG of a run's curves, or several runs overlaid for comparison.

Panels: loss (train smoothed, val), val bits per byte, HellaSwag acc_norm_token (per-token mean) with the GPT-2 /
GPT-3 124M reference lines, learning rate, gradient norm, tokens/s. A run on a mix adds each folder's val loss and
bits per byte (dotted, one marker per folder) beside the mix's.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.eval.hellaswag import GPT2_124M_ACC_NORM, GPT3_125M_ACC_NORM
from gptforge.files import atomic_write
from gptforge.rundir import read_metrics, val_sources

SOURCE_MARKERS = "s^vDPX*"
PANELS = ("loss", "val bits per byte", "HellaSwag acc_norm_token", "learning rate", "grad norm (pre-clip)", "tokens/s")


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard-style)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of `key` (a diverged step logs null; a hand-edited line may lack the key)."""
    pairs = [(r["step"], r.get(key)) for r in records]
    kept = [(s, float(v)) for s, v in pairs if isinstance(v, (int, float)) and math.isfinite(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def _records(run_dir: Path) -> dict[str, list[dict]]:
    by_kind = read_metrics(run_dir)
    if not by_kind["train"] and not by_kind["val"]:
        raise GptforgeError(f"{run_dir / 'metrics.jsonl'}: no train or val records to plot")
    return by_kind


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the PNG (default: the first run's loss.png) and return it with the titles of its panels."""
    runs = [(Path(d), _records(Path(d))) for d in run_dirs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    ax = dict(zip(PANELS, axes.flat, strict=True))
    for i, (run_dir, rec) in enumerate(runs):
        color, name = f"C{i}", run_dir.name
        train, val, hs = rec["train"], rec["val"], rec["hellaswag"]
        for panel, key in (
            ("learning rate", "lr"),
            ("grad norm (pre-clip)", "grad_norm"),
            ("tokens/s", "tokens_per_s"),
        ):
            steps, values = _series(train, key)
            ax[panel].plot(steps, values if key == "lr" else smooth(values), color=color, label=name)
        steps, losses = _series(train, "loss")
        ax["loss"].plot(steps, losses, color=color, alpha=0.2, linewidth=0.7)
        ax["loss"].plot(steps, smooth(losses), color=color, label=f"{name} train (smoothed)")
        ax["loss"].plot(*_series(val, "loss"), "o--", color=color, markersize=3, label=f"{name} val")
        ax["val bits per byte"].plot(*_series(val, "bpb"), "o-", color=color, markersize=3, label=name)
        for j, source in enumerate(val_sources(val)):
            style = {
                "color": color,
                "linestyle": ":",
                "marker": SOURCE_MARKERS[j % len(SOURCE_MARKERS)],
                "markersize": 3,
            }
            ax["loss"].plot(*_series(val, f"loss/{source}"), **style, label=f"{name} val {source}")
            ax["val bits per byte"].plot(*_series(val, f"bpb/{source}"), **style, label=f"{name} {source}")
        ax["HellaSwag acc_norm_token"].plot(*_series(hs, "acc_norm_token"), "o-", color=color, markersize=3, label=name)
    refs = ax["HellaSwag acc_norm_token"]
    refs.axhline(GPT2_124M_ACC_NORM, color="gray", linestyle="--", label=f"GPT-2 124M ({GPT2_124M_ACC_NORM:.2%})")
    refs.axhline(GPT3_125M_ACC_NORM, color="black", linestyle=":", label=f"GPT-3 125M ({GPT3_125M_ACC_NORM:.1%})")
    refs.axhline(0.25, color="lightgray", linewidth=0.8, label="chance (25%)")
    for title, a in ax.items():
        a.set_title(title)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax["loss"].set_ylabel("cross-entropy (nats/token)")
    fig.suptitle(" vs ".join(d.name for d, _ in runs))
    fig.tight_layout()
    out = Path(out) if out else runs[0][0] / "loss.png"
    if out.is_dir():
        raise GptforgeError(f"--out {out}: is a folder (expected an image file name such as loss.png)")
    kind = out.suffix[1:].lower() or "png"
    if kind not in fig.canvas.get_supported_filetypes():
        raise GptforgeError(f"--out {out}: unknown image format {kind!r} (expected .png, .pdf, .svg, ...)")
    image = io.BytesIO()
    fig.savefig(image, format=kind, dpi=100)
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, image.getvalue())
    return out, list(PANELS)
