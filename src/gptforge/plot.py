"""`gptforge plot`: a PNG of train loss (raw and smoothed), validation loss and learning rate."""

from __future__ import annotations

from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.metrics import read_metrics


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard-style)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise GptforgeError(f"{run_dir}: no metrics.jsonl (expected a folder written by `gptforge train`)")
    records = read_metrics(path)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    if not train and not val:
        raise GptforgeError(f"{path}: no train or val records to plot")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(12, 4.5))
    if train:
        steps = [r["step"] for r in train]
        losses = [r["loss"] for r in train]
        ax_loss.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8)
        ax_loss.plot(steps, smooth(losses), color="tab:blue", label="train (smoothed)")
        ax_lr.plot(steps, [r["lr"] for r in train], color="tab:green")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", color="tab:orange", label="val")
    ax_loss.set(title=f"loss — {run_dir.name}", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.set(title="learning rate", xlabel="step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "loss.png"
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
