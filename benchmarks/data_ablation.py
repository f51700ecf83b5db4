"""Which data stages pay on held-out code: one model trained at equal compute on a corpus prepared six ways.

    python benchmarks/data_ablation.py [--source SITE_PACKAGES] [--holdout pip/_vendor] [--limit-mb 60]
                                       [--steps 300] [--seeds 1337,1338] [--out runs/data-ablation] [--json FILE]

The corpus: the Python files of a site-packages folder (default: this interpreter's), whose quality varies (tests,
generated and vendored code, minified files), less `--holdout` (pip's vendored packages), which is the common test,
less every package pip vendors as installed on its own (pygments, rich, urllib3, ...: other versions of the test's
files) and every file whose text is a held-out file's (copies vendored elsewhere); then a seeded sample of whole
top-level packages up to `--limit-mb` (a sample of files would keep a tenth of a package's files and a hundredth of
its copied pairs). Prepared six ways with one tokenizer (an 8,192-token BPE trained on the standard library):
raw (no de-duplication); de-duplicated (near); + `--clean code`; + the quality classifier (reference: the standard
library) by GPT-3's Pareto rule, and by a threshold at its median score (the top half: the Pareto rule keeps ~1% of
a corpus the classifier tells apart from its reference); and the top half mixed 50/50 with the standard library.
Each is trained with `modern-cpu` for the same `--steps` (the same model and batch: the same compute), per seed,
unless it kept too few tokens to fill `--steps` x 4,096 tokens once (a pipeline that kept 0.1% would train hundreds of
epochs), then scored on the held-out packages (`eval --text`) and on the standard library's validation split.
Prints a table; nothing else should run on the machine for the prepare times.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

GPTFORGE = [sys.executable, "-m", "gptforge"]
CLEAN = ["--dedup", "near", "--clean", "code"]
PIPELINES = {  # name -> prepare's flags over the corpus (None: a mixture of the named pipeline and the stdlib)
    "raw": ["--dedup", "none"],
    "dedup": ["--dedup", "near"],
    "dedup+clean": CLEAN,
    "+quality (Pareto)": [*CLEAN, "--quality", "stdlib"],
    "+quality (top half)": [*CLEAN, "--quality", "stdlib", "--quality-threshold"],  # + the Pareto run's median
    "top half 50/50 stdlib": None,
}
MIXED = "+quality (top half)"
BATCH_TOKENS = 4096  # modern-cpu's


def gather_corpus(source: Path, holdout: Path, limit_mb: float, out: Path) -> dict:
    """Copy the held-out files and a seeded sample of whole packages (no copy of a held-out file) under `out`."""
    held = sorted(p for p in (source / holdout).rglob("*.py") if p.is_file())
    held_texts = {hashlib.sha1(p.read_bytes()).hexdigest() for p in held}
    vendored = {p.name.removesuffix(".py") for p in (source / holdout).iterdir()}
    packages: dict[str, list[Path]] = {}
    for path in source.rglob("*.py"):
        top = path.relative_to(source).parts[0]
        if path.is_file() and not path.is_relative_to(source / holdout) and top.removesuffix(".py") not in vendored:
            packages.setdefault(top, []).append(path)
    taken, size, copies, names = [], 0, 0, []
    for name in sorted(packages, key=lambda n: hashlib.sha1(n.encode()).hexdigest()):
        files = [p for p in sorted(packages[name]) if hashlib.sha1(p.read_bytes()).hexdigest() not in held_texts]
        mb = sum(p.stat().st_size for p in files)
        if size + mb <= limit_mb * 1e6:  # a package past the limit is left out, a smaller one may still fit
            taken += files
            size += mb
            names.append(name)
            copies += len(packages[name]) - len(files)
    for folder, files in (("heldout", held), ("corpus", taken)):
        for path in files:
            target = out / folder / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    held_mb = sum(p.stat().st_size for p in held) / 1e6
    summary = {"packages": sorted(names), "files": len(taken), "mb": size / 1e6, "copies_left_out": copies}
    return summary | {"heldout_files": len(held), "heldout_mb": held_mb}


def run(args: list[str], log: Path) -> float:
    """One gptforge command, its output in `log` (its stderr in log.err); seconds it took."""
    started = time.perf_counter()
    with open(log, "w") as out, open(log.with_name(f"{log.name}.err"), "w") as err:
        if subprocess.run([*GPTFORGE, *args], stdout=out, stderr=err).returncode:
            raise SystemExit(f"gptforge {' '.join(args)} failed: see {log} and {err.name}")
    return time.perf_counter() - started


def prepare_all(out: Path) -> dict[str, dict]:
    """The stdlib (its tokenizer serves every pipeline), then each pipeline's folder; tokens kept and seconds."""
    data, stages = out / "data", {}
    data.mkdir(parents=True, exist_ok=True)
    stdlib = data / "stdlib"
    if not (stdlib / "manifest.json").exists():
        run(["prepare", "stdlib", "--train-tokenizer", "8192", "--out", str(stdlib)], data / "stdlib.log")
    tokenizer = str(stdlib / "tokenizer.json")
    for name, flags in PIPELINES.items():
        if flags is None:
            continue
        if flags[-1] == "--quality-threshold":
            median = stages["+quality (Pareto)"]["score_deciles"][5]
            flags = [*flags, str(median)]
        folder = data / slug(name)
        seconds = 0.0
        if not (folder / "manifest.json").exists():
            args = ["prepare", str(out / "corpus"), "--ext", "py", "--tokenizer", tokenizer, "--out", str(folder)]
            args += ["--val-fraction", "0.02"]  # training checks its val split even unscored: the top half's stays 1%
            seconds = run([*args, *flags], data / f"{folder.name}.log")
        manifest = json.loads((folder / "manifest.json").read_text())
        train = manifest["splits"]["train"]
        stages[name] = {"folder": str(folder), "tokens": train["tokens"], "prepare_s": round(seconds, 1)}
        if "quality" in manifest["report"]:
            stages[name]["score_deciles"] = manifest["report"]["quality"]["deciles"]
    return stages


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def train_and_score(out: Path, name: str, data: list[str], seed: str, args: argparse.Namespace) -> dict:
    """Train modern-cpu for --steps on `data` (prepare-style --data, or a --set data.mix), then score it."""
    run_dir = out / "runs" / f"{slug(name)}-seed{seed}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    sets = [f"train.max_steps={args.steps}", "train.time_budget=0", f"train.seed={seed}", "eval.every=0"]
    sets += ["eval.sample_tokens=0", "checkpoint.every=0", *args.set]
    command = ["train", "--config", "modern-cpu", *data, "--out", str(run_dir)]
    seconds = 0.0
    if not (run_dir / "checkpoints").is_dir():  # a run trained before is scored again, not retrained
        seconds = run([*command, *(x for s in sets for x in ("--set", s))], run_dir.with_suffix(".log"))
    scores = {"pipeline": name, "seed": seed, "train_s": round(seconds, 1)}
    for key, flags in (("heldout", ["--text", str(out / "heldout")]), ("stdlib", ["--data", str(out / "data/stdlib")])):
        log = run_dir.with_name(f"{run_dir.name}.{key}.json")
        if not log.exists():
            run(["eval", str(run_dir), *flags, "--tokens", str(args.eval_tokens), "--json", *args.eval_flags], log)
        result = json.loads(log.read_text())
        scores[f"{key}_bpb"] = result["text" if key == "heldout" else "val"]["bpb"]
    return scores


def print_table(stages: dict[str, dict], results: list[dict]) -> None:
    raw = {r["seed"]: r for r in results if r["pipeline"] == "raw"}
    print("| pipeline | tokens kept | prepare s | seed | held-out bpb (vs raw) | stdlib val bpb (vs raw) |")
    for name in PIPELINES:
        stage = stages.get(name, {})
        kept = f"{stage['tokens']:,}" if stage else ""
        runs = [r for r in results if r["pipeline"] == name]
        if not runs:
            print(f"| {name} | {kept} | {stage.get('prepare_s', '')} | | too few tokens to train | |")
        for r in runs:
            base, held, std = raw[r["seed"]], r["heldout_bpb"], r["stdlib_bpb"]
            print(
                f"| {name} | {kept} | {stage.get('prepare_s', '')} | {r['seed']} | "
                f"{held:.3f} ({held - base['heldout_bpb']:+.3f}) | {std:.3f} ({std - base['stdlib_bpb']:+.3f}) |"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    p.add_argument("--holdout", type=Path, default=Path("pip/_vendor"))
    p.add_argument("--limit-mb", type=float, default=60.0, help="the training corpus's size before any stage")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="1337,1338")
    p.add_argument("--eval-tokens", type=int, default=262_144)
    p.add_argument("--out", type=Path, default=Path("runs/data-ablation"))
    p.add_argument("--json", type=Path)
    p.add_argument("--set", action="append", default=[], help="override for every run, e.g. train.threads=1")
    args = p.parse_args()
    threads = [s.split("=", 1)[1] for s in args.set if s.startswith("train.threads=")]
    args.eval_flags = ["--threads", threads[-1]] if threads else []
    if not (args.source / args.holdout).is_dir():
        raise SystemExit(f"--holdout: {args.source / args.holdout} is not a folder")
    corpus = {}
    if not (args.out / "corpus").exists():
        corpus = gather_corpus(args.source, args.holdout, args.limit_mb, args.out)
        print(f"corpus: {json.dumps(corpus)}", flush=True)
    stages = prepare_all(args.out)
    print(f"stages: {json.dumps(stages)}", flush=True)
    stdlib = str(args.out / "data" / "stdlib")
    results = []
    for seed in args.seeds.split(","):
        for name in PIPELINES:
            if name in stages and stages[name]["tokens"] < args.steps * BATCH_TOKENS:
                print(f"{name}: {stages[name]['tokens']:,} tokens kept, too few to train {args.steps} steps on")
                continue
            data = ["--data", stages[name]["folder"]] if name in stages else []
            data = data or ["--set", f"data.mix={stages[MIXED]['folder']}=1,{stdlib}=1"]
            results.append(train_and_score(args.out, name, data, seed, args))
            print(json.dumps(results[-1]), flush=True)
    print_table(stages, results)
    if args.json:
        args.json.write_text(json.dumps({"corpus": corpus, "stages": stages, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
