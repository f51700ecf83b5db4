"""`gptforge speedrun`: the GPT-2 recipe against the modern one on the same corpus, wall-clock budget and seeds.

Time to quality is read from each run's validation bits per byte against its training time: the summed time of
its optimizer steps, so the evaluations (the same number for both recipes) count for neither, and without the first
step, which pays one-time compilation and warm-up (13 to 38 s on an H100, by what the compile cache holds).
"""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass
from pathlib import Path

from gptforge.config import load_config
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.shards import read_manifest
from gptforge.demo import VAL_FRACTION, VOCAB_SIZE
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, check_output_dir, locked, replacing_dir, write_json
from gptforge.rundir import finite, read_metrics
from gptforge.train.trainer import train

# What every run of a speedrun shares: an evaluation every 5 steps on the same validation tokens, nothing else.
# Fewer evaluations than this per run (the first, one between, the last) locate no crossing worth reporting.
MIN_EVALUATIONS = 3
SHARED = ["eval.every=5", "eval.tokens=32768", "eval.sample_tokens=0", "eval.hellaswag=", "checkpoint.every=0"]


@dataclass
class Curve:
    """A run's validation bits per byte against its training seconds."""

    seconds: list[float]
    bpb: list[float]
    steps: int

    @property
    def final(self) -> float:
        return self.bpb[-1]

    def time_to(self, target: float) -> float | None:
        """Training seconds at which bpb first reached `target` (linear between evaluations), or None."""
        points = list(zip(self.seconds, self.bpb, strict=True))
        for (t0, b0), (t1, b1) in zip(points, points[1:], strict=False):
            if b1 <= target:
                return t0 if b0 <= target else t0 + (t1 - t0) * (b0 - target) / (b0 - b1)
        return points[0][0] if points and points[0][1] <= target else None


def read_curve(run_dir: Path) -> Curve:
    """The curve of a finished run: val records placed at the summed times of the steps after the first up to
    theirs."""
    by_kind = read_metrics(run_dir)
    elapsed, at_step = 0.0, {0: 0.0}
    for i, record in enumerate(by_kind["train"]):
        elapsed += record["ms"] / 1000 if i else 0.0
        at_step[record["step"]] = elapsed
    val = [r for r in finite(by_kind["val"], "bpb") if r["step"] in at_step]
    if not val:
        raise GptforgeError(f"{run_dir}: no validation bits per byte (does the data have a val split?)")
    if len(by_kind["train"]) < 2:  # the first step's time is left out: one step has no curve to read
        raise GptforgeError(f"{run_dir}: {len(by_kind['train'])} optimizer step; time to quality needs 2 or more")
    return Curve([at_step[r["step"]] for r in val], [r["bpb"] for r in val], by_kind["train"][-1]["step"])


def compare(curves: dict[str, Curve], baseline: str, candidate: str) -> dict:
    """One seed's result: each recipe's final bpb and training time, and when the candidate reached the baseline's
    final bpb (its share of the baseline's time: the speed-up in time to quality is its inverse)."""
    base, cand = curves[baseline], curves[candidate]
    out = {name: {"final_bpb": c.final, "seconds": c.seconds[-1], "steps": c.steps} for name, c in curves.items()}
    out["too_few_evaluations"] = {n: len(c.bpb) for n, c in curves.items() if len(c.bpb) < MIN_EVALUATIONS}
    conclusive = not out["too_few_evaluations"]
    reached = cand.time_to(base.final) if conclusive else None
    out["time_to_baseline_final"] = reached
    out["time_share"] = None if reached is None else reached / base.seconds[-1]
    out["lower_at_equal_time"] = cand.final < base.final if conclusive else None
    return out


def speedrun(
    out: str | Path,
    budget: float,
    seeds: int,
    data: str | Path | None = None,
    recipes: dict[str, str] | None = None,
    overrides: list[str] = (),
    force: bool = False,
) -> dict:
    """Train each recipe (name -> preset; the first is the baseline) for `budget` seconds with seeds S, S+1, ...
    (S: the first preset's train.seed) into OUT/NAME-seedS, then compare them; writes speedrun.json and .png."""
    recipes = recipes or {"gpt2": "demo-cpu", "modern": "modern-cpu"}
    out_dir = Path(out)
    data_dir = Path(data) if data else Path("data/stdlib")
    configs = {name: load_config(preset, [*overrides, f"data.path={data_dir}"]) for name, preset in recipes.items()}
    if data is not None:
        read_manifest(data_dir)  # a folder that is not prepared data fails here, before OUT exists
    check_output_dir(out_dir, force, reads=[data_dir])
    if data is None:  # the demo's corpus, prepared once and reused
        prepare(PrepareSettings.from_flags("stdlib", val_fraction=VAL_FRACTION, train_tokenizer=VOCAB_SIZE), data_dir)
    with locked(out_dir, "speedrun"), replacing_dir(out_dir) as work:
        first = next(iter(configs.values())).train.seed
        results = [_one_seed(first + i, configs, recipes, budget, work) for i in range(seeds)]
        summary = _summary(results, recipes, budget, data_dir, work)
        write_json(work / "speedrun.json", summary)
    summary["plot"] = str(out_dir / "speedrun.png")
    return summary


def _one_seed(seed: int, configs: dict, recipes: dict[str, str], budget: float, work: Path) -> dict:
    """Train every recipe with `seed` for `budget` seconds into WORK/NAME-seedSEED; compare the first two."""
    curves = {}
    for name, cfg in configs.items():
        run_cfg = load_config(overrides=[*SHARED, f"train.time_budget={budget}", f"train.seed={seed}"], base=cfg)
        print(f"=== speedrun: {name} ({recipes[name]}), seed {seed}, {budget:.0f}s ===", flush=True)
        train(run_cfg, work / f"{name}-seed{seed}")
        curves[name] = read_curve(work / f"{name}-seed{seed}")
    return {"seed": seed, **compare(curves, *list(recipes)[:2])}


def _summary(results: list[dict], recipes: dict[str, str], budget: float, data_dir: Path, work: Path) -> dict:
    shares = [r["time_share"] for r in results]
    summary = {
        "recipes": recipes,
        "budget_seconds": budget,
        "data": str(data_dir),
        "seeds": results,
        "median_time_share": statistics.median(shares) if None not in shares else None,
        "lower_at_equal_time_every_seed": all(r["lower_at_equal_time"] for r in results),
        "too_few_evaluations": {r["seed"]: r["too_few_evaluations"] for r in results if r["too_few_evaluations"]},
    }
    plot_curves({name: [read_curve(work / f"{name}-seed{r['seed']}") for r in results] for name in recipes},
                work / "speedrun.png")  # fmt: skip
    return summary


def plot_curves(curves: dict[str, list[Curve]], out: Path) -> None:
    """Validation bpb against training seconds, one color per recipe, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, runs) in enumerate(curves.items()):
        for seed, c in enumerate(runs):
            ax.plot(c.seconds, c.bpb, "o-", color=f"C{i}", markersize=3, label=name if seed == 0 else None)
    baseline = next(iter(curves.values()))
    for c in baseline:
        ax.axhline(c.final, color="gray", linestyle=":", linewidth=0.8)
    ax.set_xlabel("training seconds (evaluations and the first step excluded)")
    ax.set_ylabel("validation bits per byte")
    ax.set_ylim(top=min(max(c.bpb[1] if len(c.bpb) > 1 else c.bpb[0] for r in curves.values() for c in r) + 0.3, 4))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    atomic_write(out, image.getvalue())


def format_summary(summary: dict) -> str:
    """The per-seed table the command prints."""
    names = list(summary["recipes"])
    base, cand = names[0], names[1]
    lines = [
        f"{'seed':>4} | {base + ' bpb':>10} | {cand + ' bpb':>10} | {cand + ' reached ' + base + ' final at':>28}",
    ]
    for r in summary["seeds"]:
        reached = r["time_to_baseline_final"]
        when = "never" if reached is None else f"{reached:.0f}s = {r['time_share']:.0%} of {r[base]['seconds']:.0f}s"
        lines.append(f"{r['seed']:>4} | {r[base]['final_bpb']:>10.4f} | {r[cand]['final_bpb']:>10.4f} | {when:>28}")
    share = summary["median_time_share"]
    lines.append(
        f"median time to {base}'s quality: {'n/a' if share is None else f'{share:.0%} ({1 / share:.2f}x faster)'}; "
        f"{cand} lower at equal time on every seed: {'yes' if summary['lower_at_equal_time_every_seed'] else 'no'}"
    )
    for seed, few in summary.get("too_few_evaluations", {}).items():
        counts = ", ".join(f"{name} {n}" for name, n in few.items())
        lines.append(
            f"no conclusion from seed {seed}: too few evaluations ({counts}; at least {MIN_EVALUATIONS} a run): "
            "give a longer --budget"
        )
    lines.append(f"plot: {summary['plot']}")
    return "\n".join(lines)
