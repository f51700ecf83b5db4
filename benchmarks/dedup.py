"""De-duplication measured: precision and recall on planted copies, what each stage removes from real corpora, how
much of the old validation split had a near-copy in training, and prepare's throughput with and without it.

    python benchmarks/dedup.py planted [--originals 300]   # through `prepare` itself, default settings
    python benchmarks/dedup.py corpora [--corpus DIR ...]  # stdlib and each DIR's .py files
    python benchmarks/dedup.py speed [--baseline-src DIR [--baseline-name NAME]]  # MB/s of prepare; DIR: an
                                                           # older checkout's src/ (NAME: its row, e.g. a commit)
    python benchmarks/dedup.py all --json OUT.json

`corpora` judges documents with prepare's own judging pass (pipeline.encode without tokens, then pipeline.judge
in document order: the pass that picks what a trained tokenizer learns from), so its counts are prepare's.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gptforge.data import pipeline
from gptforge.data.clean.dedup import Deduplicator, DedupSettings, fingerprint
from gptforge.data.clean.filters import build_filters
from gptforge.data.languages import parse_extensions
from gptforge.data.pipeline import Job, judge
from gptforge.data.prepare import is_validation, prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.report import Report
from gptforge.data.sources import documents, resolve, stdlib_documents

CHANGED = (1, 3, 5, 10, 20)  # % of lines changed in the near copies
LICENCE = "\n".join(
    f"# Copyright 2026 The Example Authors. Licensed under the Example Licence, clause {i}." for i in range(30)
)
IMPORTS = "\n".join(f"from package.module_{i} import function_{i}, Class{i}" for i in range(25))
SHORT_LICENCE = "\n".join(  # longer than the short files it heads: without care they would pair on it alone
    f"# Licensed to the Example Foundation under one or more contributor agreements, section {i}." for i in range(16)
)


def _change(lines: list[str], percent: int, rng: random.Random, donor: list[str]) -> list[str]:
    """`percent`% of the lines (at least one) edited, deleted or replaced by a line of another file, in equal parts."""
    out = list(lines)
    for _ in range(max(1, round(len(lines) * percent / 100))):
        i, op = rng.randrange(len(out)), rng.choice(["edit", "delete", "insert"])
        if op == "edit":
            out[i] = out[i] + f"  # changed {rng.randrange(10**6)}"
        elif op == "delete" and len(out) > 1:
            del out[i]
        else:
            out.insert(i, rng.choice(donor))
    return out


def _distinct_originals(n: int, seed: int, lines: range = range(40, 10**9)) -> list[tuple[str, str]]:
    """`n` stdlib files of `lines` lines that prepare keeps when read alone (no two of them duplicates)."""
    dedup, picked = Deduplicator(DedupSettings()), []
    files = [(name, text) for name, text in stdlib_documents() if len(text.splitlines()) in lines]
    random.Random(seed).shuffle(files)
    for name, text in files:
        if dedup.check(len(picked), fingerprint(text, DedupSettings())) is None:
            picked.append((name, text))
        if len(picked) == n:
            return picked
    return picked


def planted(originals: int, seed: int, workers: int) -> dict:
    """Recall per kind of copy and the distinct files removed, each kind prepared beside the originals."""
    rng = random.Random(seed)
    pool = _distinct_originals(originals + 100, seed)
    base, spare = pool[:originals], pool[originals:]
    donor = [line for _, text in spare for line in text.splitlines() if line.strip()]
    kinds: dict[str, list[str]] = {"exact": [text for _, text in base[:50]]}
    for k in CHANGED:
        kinds[f"{k}% lines changed"] = [
            "\n".join(_change(text.splitlines(), k, rng, donor)) for _, text in rng.sample(base, 50)
        ]
    short = _distinct_originals(50, seed, lines=range(5, 16))
    distinct = {
        "distinct, shared 30-line licence": [f"{LICENCE}\n{text}" for _, text in spare[:50]],
        "distinct, shared 25-line imports": [f"{IMPORTS}\n{text}" for _, text in spare[50:100]],
        "distinct 5-15-line files, shared 16-line licence": [f"{SHORT_LICENCE}\n{text}" for _, text in short],
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, texts in {**kinds, **distinct}.items():
            folder = Path(tmp) / "src"
            if folder.exists():
                subprocess.run(["rm", "-rf", str(folder)], check=True)
            folder.mkdir()
            for i, (_, text) in enumerate(base):
                (folder / f"a_{i:04d}.py").write_text(text)
            for i, text in enumerate(texts):  # named after the originals: the original is the one kept
                (folder / f"z_{i:04d}.py").write_text(text)
            settings = PrepareSettings.from_flags(str(folder), val_fraction=0)
            dest = Path(tmp) / kind.replace("%", "pct").replace(" ", "_").replace(",", "")
            m = prepare(settings, dest, workers=workers, force=True)
            stages = m["report"]["stages"]
            removed = stages["exact duplicates"]["docs"] + stages["near duplicates"]["docs"]
            rows[kind] = {"planted": len(texts), "removed": removed, "copies": kind in kinds}
    tp = sum(r["removed"] for r in rows.values() if r["copies"])
    fp = sum(r["removed"] for r in rows.values() if not r["copies"])
    return {"settings": DedupSettings().__dict__, "originals": len(base), "kinds": rows,
            "precision": tp / (tp + fp) if tp + fp else 1.0}  # fmt: skip


def _judged(docs: Iterator[tuple[str, str]], clean: str, val_fraction: float, workers: int) -> dict:
    """prepare's decisions on `docs` (dedup near, filters of `clean`): stage counts, and with dedup off, which
    validation documents have a near-copy among the training ones."""
    settings, filters = DedupSettings(), build_filters(clean)
    docs = [(n, t) for n, t in docs if t.strip()]
    splits = ["val" if is_validation(n, i, val_fraction) else "train" for i, (n, _) in enumerate(docs)]
    jobs = (Job(i, splits[i], n, t, tokenize=False) for i, (n, t) in enumerate(docs))
    dedup, report, names, outcomes = Deduplicator(settings), Report(), {}, []
    with pipeline.start_pool(pipeline.worker_count(workers), None, frozenset(), filters, settings) as pool:
        for batch, _ in pool.imap(pipeline.encode, pipeline.batched(jobs)):
            for o in batch:
                judge(o, dedup, report, names)
                outcomes.append(o)
    train_only = Deduplicator(settings)  # the old split: training documents, then each validation one against them
    for o in outcomes:
        if o.split == "train" and o.fingerprint is not None:
            train_only.check(o.index, o.fingerprint)
    val = [o for o in outcomes if o.split == "val"]
    leaked = [o for o in val if o.fingerprint is not None and train_only.match(o.fingerprint) is not None]
    return {
        "stages": report.to_json()["stages"],
        "filters": report.to_json()["filters"],
        "val_docs": len(val),
        "val_bytes": sum(o.n_bytes for o in val),
        "val_leaked_docs": len(leaked),
        "val_leaked_bytes": sum(o.n_bytes for o in leaked),
        "leaked_examples": [(o.name, docs[train_only.match(o.fingerprint).of][0]) for o in leaked[:5]],
    }


def corpora(folders: list[str], workers: int) -> dict:
    """Each corpus judged with dedup near and with --clean code; the demo's split (2%) for the leak."""
    out = {}
    for name, docs in [
        ("stdlib", stdlib_documents),
        *((f, lambda f=f: documents(*resolve(f, None), extensions=parse_extensions("py"))) for f in folders),
    ]:
        for clean in ("none", "code"):
            t = time.perf_counter()
            out[f"{name} --clean {clean}"] = {
                **_judged(docs(), clean, 0.02, workers),
                "seconds": time.perf_counter() - t,
            }
    return out


def _timed(src: str | None, args: list[str]) -> float:
    """Seconds of `gptforge prepare stdlib ARGS` in a fresh process (from checkout `src`, or this one)."""
    env = None if src is None else {"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}
    code = "import sys; from gptforge.cli import main; sys.exit(main(sys.argv[1:]))"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, "prepare", "stdlib", *args], check=True, env=env, capture_output=True)
    return time.perf_counter() - t


def speed(baseline_src: str | None, repeats: int, baseline_name: str = "baseline") -> dict:
    """prepare's MB/s on the stdlib (GPT-2 BPE, all cores), the variants taking turns so load hits all alike."""
    mb = sum(len(t.encode()) for _, t in stdlib_documents()) / 1e6
    variants = {
        "dedup none": ["--dedup", "none"],
        "dedup near (default)": [],
        "dedup near, clean code": ["--clean", "code"],
    }
    runs: dict[str, list[float]] = {name: [] for name in ([*([baseline_name] if baseline_src else []), *variants])}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in runs:
                out = ["--out", f"{tmp}/{r}-{len(runs[name])}-{name.replace(' ', '_').replace(',', '')}"]
                src = baseline_src if name == baseline_name else None
                runs[name].append(_timed(src, [*variants.get(name, []), *out]))
    return {name: {"seconds": min(s), "mb_per_s": mb / min(s)} for name, s in runs.items()} | {"mb": mb}


def _cell(stage: dict) -> str:
    return f"{stage['docs']:,} ({stage['bytes'] / 1e6:.2f} MB)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("planted", "corpora", "speed", "all"))
    p.add_argument("--originals", type=int, default=300)
    p.add_argument("--corpus", action="append", default=[], help="a folder of .py files (site-packages, ...)")
    p.add_argument("--baseline-src", help="src/ of an older checkout, for the speed comparison (its default run)")
    p.add_argument("--baseline-name", default="baseline", help="the baseline's row name (e.g. its commit)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = {}
    if args.part in ("planted", "all"):
        results["planted"] = r = planted(args.originals, args.seed, args.workers)
        print(f"planted copies of {r['originals']} distinct stdlib files (settings {r['settings']}):")
        print("| kind | planted | removed | share removed |\n| --- | ---: | ---: | ---: |")
        for kind, row in r["kinds"].items():
            print(f"| {kind} | {row['planted']} | {row['removed']} | {row['removed'] / row['planted']:.2f} |")
        print(f"precision {r['precision']:.3f}")
    if args.part in ("corpora", "all"):
        results["corpora"] = c = corpora(args.corpus, args.workers)
        print("| corpus | read | exact | near | filtered | kept | old val split with a near-copy in train |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, row in c.items():
            cells = [
                _cell(row["stages"][k]) for k in ("read", "exact duplicates", "near duplicates", "filtered", "kept")
            ]
            share = row["val_leaked_bytes"] / max(1, row["val_bytes"])
            leak = f"{row['val_leaked_docs']}/{row['val_docs']} docs, {share:.1%} of bytes"
            print(f"| {name} | {' | '.join(cells)} | {leak} |")
    if args.part in ("speed", "all"):
        results["speed"] = s = speed(args.baseline_src, args.repeats, args.baseline_name)
        for name, row in s.items():
            if name != "mb":
                print(f"prepare stdlib, {name}: {row['seconds']:.1f}s = {row['mb_per_s']:.2f} MB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
