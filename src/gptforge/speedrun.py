"""`gptforge speedrun`: the GPT-2 recipe against the modern one on the same corpus, wall-clock budget and seeds.

Time to quality is read from each run's validation bits per byte against its training time: the summed time of
its optimizer steps, so the evaluations (the same number for both recipes) count for neither, and without the first
step, which pays one-time compilation and warm-up (13 to 38 s on an H100, by what the compile cache holds).

The recipes train minutes apart, and a shared host's speed changes by 2x or more in minutes. So a fixed matmul is
timed beside each run's steps (`PaceMeter`), and each step's time is put at a common pace, the speedrun's median:
a step taken while the host ran at half that speed counts half its time.
"""

from __future__ import annotations

import io
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gptforge.config import Config, load_config
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.shards import read_manifest
from gptforge.demo import VAL_FRACTION, VOCAB_SIZE
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, replacing_dir, write_json
from gptforge.outputs import check_output_dir, locked, output_folder
from gptforge.rundir import finite, read_metrics
from gptforge.runtime.device import resolve_device
from gptforge.runtime.threads import sustained_matmul_flops, use_threads
from gptforge.train.trainer import train

# What every run of a speedrun shares: an evaluation every 5 steps on the same validation tokens, nothing else.
# Fewer evaluations than this per run (the first, one between, the last) locate no crossing worth reporting.
MIN_EVALUATIONS = 3
SHARED = ["eval.every=5", "eval.tokens=32768", "eval.sample_tokens=0", "eval.hellaswag=", "checkpoint.every=0"]
# The pace probe: `sustained_matmul_flops` (fp32, the run's threads) for PROBE_SECONDS, on entry, after an optimizer
# step at most every PROBE_EVERY seconds, and on exit; never more than PROBE_SHARE of the time (loaded, a product takes
# longer). Sustained, not one product: a loaded host's pace shows over many scheduler slices, not in one.
PROBE_SECONDS, PROBE_EVERY, PROBE_SHARE = 0.05, 2.0, 0.05


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

    def at(self, second: float) -> float:
        """bpb at training second `second` (linear between evaluations; the last one's past the end)."""
        points = list(zip(self.seconds, self.bpb, strict=True))
        for (t0, b0), (t1, b1) in zip(points, points[1:], strict=False):
            if second <= t1:
                return b1 if t1 == t0 else b0 + (b1 - b0) * (max(second, t0) - t0) / (t1 - t0)
        return self.final


@dataclass
class Probe:
    """One timing of the pace probe."""

    at: float
    """When it started, by the wall clock (time.time(), as metrics.jsonl's records)."""
    seconds: float
    gflops: float


class PaceMeter:
    """The host's pace beside a run on the CPU: the probe timed on entry, after optimizer steps while the block runs
    (torch's global optimizer hook: the trainer offers no other per-step hook), and on exit. A GPU is not probed:
    its steps are not slowed by other work the way shared cores are."""

    def __init__(self, device: torch.device, threads: int = 0) -> None:
        self.on, self.probes = device.type == "cpu", []
        if self.on:
            use_threads(threads)  # the run's threads, as the trainer sets them
        self._next, self._hook = 0.0, None

    def measure(self) -> None:
        at, start = time.time(), time.perf_counter()
        flops = sustained_matmul_flops(torch.get_num_threads(), torch.float32, seconds=PROBE_SECONDS)
        took = time.perf_counter() - start
        self.probes.append(Probe(at, took, flops / 1e9))
        self._next = time.perf_counter() + max(PROBE_EVERY, took / PROBE_SHARE)

    def _after_step(self, optimizer, args, kwargs) -> None:
        if time.perf_counter() >= self._next:
            self.measure()

    def __enter__(self) -> PaceMeter:
        if self.on:
            self.measure()
            self._hook = register_optimizer_step_post_hook(self._after_step)
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            self._hook.remove()
            self.measure()


def step_seconds(train: list[dict], probes: list[Probe], reference: float | None = None) -> list[float]:
    """Each train record's step seconds, less the probes timed inside it (from its optimizer step); with a
    `reference` pace (GFLOP/s), scaled by the latest probe's pace to it: at half the pace, half the time counts."""
    out, since = [], float("-inf")
    for record in train:
        seconds = record["ms"] / 1000 - sum(p.seconds for p in probes if since < p.at <= record["time"])
        if probes and reference:
            latest = [p for p in probes if p.at <= record["time"]] or probes[:1]
            seconds *= latest[-1].gflops / reference
        out.append(max(seconds, 0.0))
        since = record["time"]
    return out


def read_curve(run_dir: Path, probes: list[Probe] = (), reference: float | None = None) -> Curve:
    """The curve of a finished run: val records placed at the summed times of the steps after the first up to
    theirs (`step_seconds`: net of `probes`, at the `reference` pace when given)."""
    by_kind = read_metrics(run_dir)
    elapsed, at_step = 0.0, {0: 0.0}
    for i, seconds in enumerate(step_seconds(by_kind["train"], list(probes), reference)):
        elapsed += seconds if i else 0.0
        at_step[by_kind["train"][i]["step"]] = elapsed
    val = [r for r in finite(by_kind["val"], "bpb") if r["step"] in at_step]
    if not val:
        raise GptforgeError(f"{run_dir}: no validation bits per byte (does the data have a val split?)")
    if len(by_kind["train"]) < 2:  # the first step's time is left out: one step has no curve to read
        raise GptforgeError(f"{run_dir}: {len(by_kind['train'])} optimizer step; time to quality needs 2 or more")
    return Curve([at_step[r["step"]] for r in val], [r["bpb"] for r in val], by_kind["train"][-1]["step"])


def compare(curves: dict[str, Curve], baseline: str, candidate: str) -> dict:
    """One seed's result: each recipe's final bpb and training time, when the candidate reached the baseline's
    final bpb (its share of the baseline's time: the speed-up in time to quality is its inverse), and whether it was
    lower when the shorter run ended."""
    base, cand = curves[baseline], curves[candidate]
    out = {name: {"final_bpb": c.final, "seconds": c.seconds[-1], "steps": c.steps} for name, c in curves.items()}
    out["too_few_evaluations"] = {n: len(c.bpb) for n, c in curves.items() if len(c.bpb) < MIN_EVALUATIONS}
    conclusive = not out["too_few_evaluations"]
    reached = cand.time_to(base.final) if conclusive else None
    out["time_to_baseline_final"] = reached
    out["time_share"] = None if reached is None else reached / base.seconds[-1]
    equal = min(base.seconds[-1], cand.seconds[-1])  # at a common pace, a run slowed down trained less of it
    out["lower_at_equal_time"] = cand.at(equal) < base.at(equal) if conclusive else None
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
    out_dir = output_folder(out)  # '' is no folder (Path('') would be the current one)
    data_dir = Path(data) if data else Path("data/stdlib")
    configs = {name: load_config(preset, [*overrides, f"data.path={data_dir}"]) for name, preset in recipes.items()}
    if data is not None:
        read_manifest(data_dir)  # a folder that is not prepared data fails here, before OUT exists
    check_output_dir(out_dir, force, reads=[data_dir], writes_runs=True)  # OUT/NAME-seedS are its own runs
    if data is None:  # the demo's corpus, prepared once and reused
        prepare(PrepareSettings.from_flags("stdlib", val_fraction=VAL_FRACTION, train_tokenizer=VOCAB_SIZE), data_dir)
    with locked(out_dir, "speedrun"), replacing_dir(out_dir) as work:
        first = next(iter(configs.values())).train.seed
        seed_list = range(first, first + seeds)
        runs = {(name, seed): work / f"{name}-seed{seed}" for seed in seed_list for name in configs}
        probes = {key: _train_run(configs[key[0]], key, recipes, budget, run) for key, run in runs.items()}
        speeds = [p.gflops for run in probes.values() for p in run]
        reference = statistics.median(speeds) if speeds else None  # None: GPU runs, not probed
        curves = {key: read_curve(run, probes[key], reference) for key, run in runs.items()}
        results = [_seed_result(seed, runs, curves, probes, reference) for seed in seed_list]
        summary = _summary(results, recipes, budget, data_dir, reference)
        plot_curves({name: [curves[name, seed] for seed in seed_list] for name in recipes}, work / "speedrun.png")
        write_json(work / "speedrun.json", summary)
    summary["plot"] = str(out_dir / "speedrun.png")
    return summary


def _train_run(cfg: Config, key: tuple[str, int], recipes: dict[str, str], budget: float, run: Path) -> list[Probe]:
    """Train recipe NAME with SEED for `budget` seconds into `run`; the pace probes timed beside it."""
    (name, seed), preset = key, recipes[key[0]]
    run_cfg = load_config(overrides=[*SHARED, f"train.time_budget={budget}", f"train.seed={seed}"], base=cfg)
    print(f"=== speedrun: {name} ({preset}), seed {seed}, {budget:.0f}s ===", flush=True)
    with PaceMeter(resolve_device(run_cfg.train.device), run_cfg.train.threads) as meter:
        train(run_cfg, run)
    return meter.probes


def _seed_result(seed: int, runs: dict, curves: dict, probes: dict, reference: float | None) -> dict:
    """`compare` of the seed's first two recipes, with each recipe's steps' own seconds and the host's pace seen."""
    names = [name for name, s in runs if s == seed]
    result = {"seed": seed, **compare({name: curves[name, seed] for name in names}, *names[:2])}
    for name in names:
        speeds = [p.gflops for p in probes[name, seed]]
        result[name]["wall_seconds"] = read_curve(runs[name, seed], probes[name, seed]).seconds[-1]
        result[name]["host_pace"] = None  # a GPU run: not probed
        if speeds:
            median = statistics.median(speeds)
            result[name]["host_pace"] = {
                "median_gflops": median,
                "min_gflops": min(speeds),
                "probes": len(speeds),
                "of_common": median / reference,
            }
    return result


def _summary(
    results: list[dict], recipes: dict[str, str], budget: float, data_dir: Path, reference: float | None
) -> dict:
    shares = [r["time_share"] for r in results]
    return {
        "recipes": recipes,
        "budget_seconds": budget,
        "data": str(data_dir),
        "common_pace_gflops": reference,
        "seeds": results,
        "median_time_share": statistics.median(shares) if None not in shares else None,
        "lower_at_equal_time_every_seed": all(r["lower_at_equal_time"] for r in results),
        "too_few_evaluations": {r["seed"]: r["too_few_evaluations"] for r in results if r["too_few_evaluations"]},
    }


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
    ax.set_xlabel("training seconds at the common host pace (evaluations and the first step excluded)")
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
        f"{'seed':>4} | {base + ' bpb':>10} | {cand + ' bpb':>10} | {cand + ' reached ' + base + ' final at':>28} | "
        f"host pace, median and min: {base}; {cand}",
    ]
    for r in summary["seeds"]:
        reached = r["time_to_baseline_final"]
        when = "never" if reached is None else f"{reached:.0f}s = {r['time_share']:.0%} of {r[base]['seconds']:.0f}s"
        pace = "; ".join(_pace(r[name]["host_pace"], summary["common_pace_gflops"]) for name in (base, cand))
        lines.append(
            f"{r['seed']:>4} | {r[base]['final_bpb']:>10.4f} | {r[cand]['final_bpb']:>10.4f} | {when:>28} | {pace}"
        )
    common = summary["common_pace_gflops"]
    lines.append(
        "times: training steps' seconds as measured (on a GPU the host's pace is not probed)"
        if common is None
        else f"times: training steps' seconds at the common host pace, {common:.1f} GFLOP/s (the median of a matmul "
        "probe timed beside every run); a pace of 0.5x: the host ran at half of it"
    )
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


def _pace(pace: dict | None, common: float | None) -> str:
    """A run's host pace against the common one, median and min ('n/a' where not probed)."""
    return f"{pace['median_gflops'] / common:.2f}x {pace['min_gflops'] / common:.2f}x" if pace else "n/a"
