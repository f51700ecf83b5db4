"""gptforge's near-duplicate removal beside datatrove's MinHash pipeline (the engine FineWeb was built with) on the
same code corpus: what each removes, how close each removed file is to the copy kept (the exact Jaccard of the two
files' 5-word shingles, gptforge's, one measure for both), planted copies found, CPU time and peak memory.

    python benchmarks/dedup_datatrove.py [--src DIR] [--mb 100] [--planted 100] [--json OUT.json]

The corpus: DIR's .py files (default: this interpreter's site-packages), sorted by path, up to --mb megabytes, then
--planted exact copies and as many copies with 3% of their lines changed (benchmarks/dedup.py's edits) of files
drawn from it. Each engine runs alone in a fresh process on one core: gptforge's de-duplication stage as prepare runs
it (exact, then near with pair verification; no tokenizing), and datatrove 0.10's four MinHash stages with 5-gram
shingles and 32 buckets of 4 hashes, its defaults otherwise, cluster ids kept so that each removal can be traced to
the copy its cluster keeps. datatrove's English word tokenizer needs spaCy (`pip install datatrove spacy orjson`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from dedup import _change

from gptforge.data.clean.dedup import Deduplicator, DedupSettings, fingerprint, jaccard, shingle_hashes, without_header

SHINGLE, BUCKETS, ROWS = 5, 32, 4


def corpus(src: Path, mb: float, planted: int, seed: int) -> list[dict]:
    """Documents {id, text}: the sorted .py files up to `mb` MB, then the planted copies (ids planted/...)."""
    docs, size = [], 0
    for path in sorted(src.rglob("*.py")):
        try:
            text = path.read_bytes().decode()
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append({"id": str(path.relative_to(src)), "text": text})
        size += len(text.encode())
        if size >= mb * 1e6:
            break
    rng = random.Random(seed)
    long = [d for d in docs if len(d["text"].splitlines()) >= 40]
    originals = rng.sample(long, planted)
    donor = [line for d in rng.sample(long, 50) for line in d["text"].splitlines() if line.strip()]
    for i, d in enumerate(originals):
        docs.append({"id": f"planted/exact/{i:04d}|{d['id']}", "text": d["text"]})
        edited = "\n".join(_change(d["text"].splitlines(), 3, rng, donor))
        docs.append({"id": f"planted/edit3/{i:04d}|{d['id']}", "text": edited})
    return docs


def run_ours(docs: list[dict]) -> list[dict]:
    """prepare's rule, document by document in source order: each removal names the earliest kept match."""
    dedup, out = Deduplicator(DedupSettings()), []
    for i, d in enumerate(docs):
        verdict = dedup.check(i, fingerprint(d["text"], DedupSettings(), "Python"))
        if verdict is not None:
            out.append({"removed": d["id"], "kept": docs[verdict.of]["id"], "stage": verdict.kind})
    return out


def run_datatrove(docs_dir: Path, work: Path) -> list[dict]:
    """datatrove's four stages, one task at a time in this process; removals traced through the cluster ids."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    config = MinhashConfig(n_grams=SHINGLE, num_buckets=BUCKETS, hashes_per_bucket=ROWS)
    reader = JsonlReader(str(docs_dir), id_key="id")
    stages = [
        ([reader, MinhashDedupSignature(output_folder=str(work / "sigs"), config=config)], 1),
        ([MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"), config=config)],
         BUCKETS),
        ([MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove"), config=config,
                              save_cluster_id=True)], 1),
        ([reader, MinhashDedupFilter(input_folder=str(work / "remove"), load_cluster_ids=True,
                                     exclusion_writer=JsonlWriter(str(work / "removed"), compression=None)),
          JsonlWriter(str(work / "kept"), compression=None)], 1),
    ]  # fmt: skip
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=str(work / f"logs{i}")).run()

    def rows(folder: str):
        for path in sorted((work / folder).glob("*.jsonl")):
            yield from map(json.loads, path.read_text().splitlines())

    def cluster(row: dict) -> int:
        return row["metadata"]["minhash_cluster_id"]

    kept_of = {cluster(r): r["id"] for r in rows("kept") if cluster(r) >= 0}
    return [
        {"removed": r["id"], "kept": kept_of[cluster(r)], "stage": "minhash", "cluster": cluster(r)}
        for r in rows("removed")
    ]


def child(engine: str, docs_path: Path, out: Path) -> None:
    """One engine's removals, its CPU seconds and peak memory, written to `out`."""
    with tempfile.TemporaryDirectory() as work:
        if engine == "gptforge":
            removals = run_ours([json.loads(line) for line in docs_path.read_text().splitlines()])
        else:
            removals = run_datatrove(docs_path.parent, Path(work))
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    out.write_text(json.dumps({
        "removals": removals,
        "cpu_s": sum(u.ru_utime + u.ru_stime for u in usage),
        "peak_mb": max(u.ru_maxrss for u in usage) / 1024,
    }))  # fmt: skip


def summary(result: dict, texts: dict[str, str]) -> dict:
    """Removals by exact Jaccard to the kept copy, planted copies found, clusters."""
    shingles = {}

    def of(name: str) -> np.ndarray:
        if name not in shingles:
            shingles[name] = np.unique(shingle_hashes(without_header(texts[name], "Python"), SHINGLE))
        return shingles[name]

    removals = result["removals"]
    similarity = [jaccard(of(r["removed"]), of(r["kept"])) for r in removals]
    removed = {r["removed"] for r in removals}
    groups = {r["removed"]: r["kept"] for r in removals}
    planted = [name for name in texts if name.startswith("planted/")]

    def found(name: str) -> bool:  # the copy or its original went, the two traced to one kept file
        original = name.split("|", 1)[1]
        return groups.get(name, name) == groups.get(original, original) and bool({name, original} & removed)

    clusters = Counter(r.get("cluster") for r in removals if "cluster" in r)
    return {
        "removed": len(removals),
        "removed_mb": sum(len(texts[n].encode()) for n in removed) / 1e6,
        "jaccard_at_least_0.7": sum(s >= 0.7 for s in similarity),
        "jaccard_below_0.5": sum(s < 0.5 for s in similarity),
        "lowest_jaccard": min(similarity, default=None),
        "by_stage": dict(Counter(r["stage"] for r in removals)),
        "planted_found": {kind: sum(found(n) for n in planted if f"/{kind}/" in n) for kind in ("exact", "edit3")},
        "planted": len(planted) // 2,
        "largest_cluster_files": max(clusters.values()) + 1 if clusters else None,
        "cpu_s": result["cpu_s"],
        "peak_mb": result["peak_mb"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--planted", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--child", nargs=3, metavar=("ENGINE", "DOCS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child[0], Path(a.child[1]), Path(a.child[2]))
        return
    docs = corpus(a.src, a.mb, a.planted, a.seed)
    texts = {d["id"]: d["text"] for d in docs}
    mb = sum(len(t.encode()) for t in texts.values()) / 1e6
    results = {"corpus": {"src": str(a.src), "files": len(docs), "mb": mb, "planted": a.planted}}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "docs").mkdir()
        docs_path = Path(tmp) / "docs" / "docs.jsonl"
        docs_path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        for engine in ("gptforge", "datatrove"):
            out = Path(tmp) / f"{engine}.json"
            cmd = [sys.executable, __file__, "--child", engine, str(docs_path), str(out)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core each, as datatrove's tasks run here
            done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                sys.exit(f"{engine} failed:\n{done.stderr[-3000:]}")
            results[engine] = summary(json.loads(out.read_text()), texts)
            print(engine, json.dumps(results[engine]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
