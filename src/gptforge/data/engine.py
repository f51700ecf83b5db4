"""Where prepare's per-document stages run: worker processes on this machine (`local`), or N tasks on a datatrove
executor (`datatrove`: its local executor, or Ray's across a cluster) for corpora past one machine.

Both engines run the same per-document function (pipeline.encode) and the same in-order decision and shard writing
in the gptforge process (pipeline.judge, ShardWriter), so they write the same shards byte for byte. Datatrove's own
MinHash stages are not used: they need spaCy and xxhash extras, and they cluster duplicates transitively, which
would keep other documents than our earliest-kept rule. The decision runs in one process over the fingerprints:
a 128-hash signature is 512 bytes a document (about 5 GB for 10 million documents).
"""

from __future__ import annotations

import functools
import heapq
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gptforge.data import pipeline
from gptforge.data.clean.dedup import DedupSettings, Fingerprint
from gptforge.data.clean.filters import Filter
from gptforge.data.clean.quality import Classifier
from gptforge.data.pipeline import Job, Outcome
from gptforge.data.sources import documents
from gptforge.errors import GptforgeError

ENGINES = ("local", "datatrove")
EXECUTORS = ("local", "ray", "slurm")
WORK_DIR = ".datatrove"  # inside the folder being built: removed once the manifest is written


@dataclass(frozen=True)
class EngineSettings:
    """--engine, --tasks, --executor; not part of the data's settings, since both engines write the same shards."""

    name: str = "local"
    tasks: int = 1
    executor: str = "local"
    slurm_partition: str = ""
    slurm_time: str = "24:00:00"


LOCAL = EngineSettings()
DATATROVE_FLAGS = {"--tasks": "tasks", "--executor": "executor", "--slurm-partition": "slurm_partition",
                   "--slurm-time": "slurm_time"}  # fmt: skip


def check_engine(engine: EngineSettings) -> EngineSettings:
    """The engine settings, or one line naming the flag that cannot work (the extra it needs, too)."""
    if engine.name not in ENGINES:
        raise GptforgeError(f"--engine {engine.name!r}: expected one of {', '.join(ENGINES)}")
    for flag, name in DATATROVE_FLAGS.items() if engine.name == "local" else ():
        if getattr(engine, name) != getattr(LOCAL, name):  # the local engine would ignore it
            raise GptforgeError(f"{flag} {getattr(engine, name)}: applies to --engine datatrove only")
    if engine.tasks < 1:
        raise GptforgeError(f"--tasks must be positive, got {engine.tasks}")
    if engine.executor not in EXECUTORS:
        raise GptforgeError(f"--executor {engine.executor!r}: expected one of {', '.join(EXECUTORS)}")
    if engine.executor == "slurm" and not engine.slurm_partition:
        raise GptforgeError("--executor slurm needs --slurm-partition NAME (the partition its tasks run on)")
    needs = {"datatrove": "datatrove", **({"ray": "ray"} if engine.executor == "ray" else {})}
    for module, extra in needs.items() if engine.name == "datatrove" else ():
        if importlib.util.find_spec(module) is None:
            raise GptforgeError(f"--engine datatrove needs {module}: pip install 'gptforge[{extra}]'")
    return engine


@dataclass(frozen=True, repr=False)
class Share:
    """What each datatrove task needs to encode its share of the documents (picklable: it travels to the tasks)."""

    source: str
    text_field: str | None
    extensions: frozenset[str]
    val_fraction: float
    seed: int
    spec: str
    ngrams: frozenset[int]
    filters: list[Filter]
    dedup: DedupSettings
    work: str
    quality: Classifier | None = None  # trained once, before the tasks: each scores its documents with the same one

    def __repr__(self) -> str:  # datatrove logs its pipeline: a line, not every filter's settings
        return f"gptforge encode of {self.source} into {self.work}"


def encode_share(share: Share, rank: int, world_size: int) -> int:
    """Task `rank`'s documents (index % world_size == rank), encoded and written under WORK_DIR; returns how many.
    Every task reads the listing (a document's index counts the documents with text before it); the per-document
    work, the costly part, is what is split."""
    pipeline.load_worker(share.spec, share.ngrams, share.filters, share.dedup, quality=share.quality)
    skipped: list[tuple[str, int, str]] = []
    listing = documents(share.source, share.text_field, extensions=share.extensions, skipped=skipped)
    docs = pipeline.nonempty(listing, skipped)
    jobs = (
        Job(i, "val" if pipeline.is_validation(n, i, share.val_fraction, share.seed) else "train", n, t, tokenize=True)
        for i, (n, t) in enumerate(docs)
        if i % world_size == rank
    )
    records, parts = [], []
    for batch in pipeline.batched(jobs):
        outcomes, tokens = pipeline.encode(batch)
        records += [_record(o) for o in outcomes]
        parts.append(tokens)
    base = Path(share.work) / f"{rank:05d}"
    if rank == 0:  # every task reads the listing: one says what it skipped
        Path(f"{base}.skipped.json").write_text(json.dumps(skipped))
    tmp = base.with_suffix(".tmp.npy")
    np.save(tmp, np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16))
    Path(f"{base}.jsonl.tmp").write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, f"{base}.npy")
    os.replace(f"{base}.jsonl.tmp", f"{base}.jsonl")  # last: its presence says the task is complete
    return len(records)


def datatrove_pipeline(share: Share) -> list[Any]:
    """The pipeline a datatrove executor runs (local, Ray, Slurm: README's "Past one machine"): one step, in the
    form datatrove takes for a custom one (a function of data, rank and world size)."""
    return [functools.partial(_encode_step, share)]


def _encode_step(share: Share, data: Any, rank: int = 0, world_size: int = 1) -> Iterator[Any]:
    encode_share(share, rank, world_size)
    yield from ()


def datatrove_outcomes(
    share: Share, engine: EngineSettings, skipped: list[tuple[str, int, str]]
) -> Iterator[tuple[list[Outcome], np.ndarray]]:
    """Run the tasks not yet complete on the executor, then every document's outcome and tokens in document order;
    the files the reading skipped go to `skipped` (task 0 lists them)."""
    work = Path(share.work)
    count = work / "tasks"
    if work.exists() and (not count.is_file() or count.read_text() != str(engine.tasks)):
        # Task i takes the documents whose index modulo the task count is i: another count's finished tasks hold
        # other shares, and keeping them dropped every document in the shares of the tasks that had not finished.
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    count.write_text(str(engine.tasks))
    logs = str(work / "logs")
    if engine.executor == "ray":
        from datatrove.executor.ray import RayPipelineExecutor

        executor = RayPipelineExecutor(datatrove_pipeline(share), tasks=engine.tasks, logging_dir=logs)
    elif engine.executor == "slurm":  # sbatch returns at once: the tasks run later, on the cluster's nodes
        from datatrove.executor.slurm import SlurmPipelineExecutor

        activate = Path(sys.prefix) / "bin" / "activate"
        executor = SlurmPipelineExecutor(
            datatrove_pipeline(share), tasks=engine.tasks, time=engine.slurm_time, partition=engine.slurm_partition,
            logging_dir=logs, job_name="gptforge-prepare", venv_path=str(activate) if activate.is_file() else None,
        )  # fmt: skip
    else:
        from datatrove.executor.local import LocalPipelineExecutor

        workers = min(engine.tasks, pipeline.cpu_count())
        executor = LocalPipelineExecutor(
            datatrove_pipeline(share), tasks=engine.tasks, workers=workers, logging_dir=logs, start_method="spawn"
        )
    executor.run()
    missing = [r for r in range(engine.tasks) if not (work / f"{r:05d}.jsonl").is_file()]
    if missing and engine.executor == "slurm":
        raise GptforgeError(
            f"{len(missing)} of {engine.tasks} datatrove tasks are with Slurm (job {executor.job_id}; logs: {logs}); "
            "run the same command again once they have finished, to write the shards"
        )
    if missing:
        raise GptforgeError(
            f"{len(missing)} of {engine.tasks} datatrove tasks did not finish (their logs: {logs}); run the same "
            "command again: the finished ones are kept"
        )
    # Task 0's list replaces what this process met reading up to its first document: each file is counted once.
    skipped[:] = [tuple(s) for s in json.loads((work / "00000.skipped.json").read_text())]
    streams = [_read_task(work / f"{r:05d}") for r in range(engine.tasks)]
    for outcome, tokens in heapq.merge(*streams, key=lambda pair: pair[0].index):
        yield [outcome], tokens


def _record(o: Outcome) -> dict[str, Any]:
    fp = o.fingerprint
    sig = None if fp is None or fp.signature is None else fp.signature.tobytes().hex()
    shingles = None if fp is None or fp.shingles is None else fp.shingles.tobytes().hex()
    return {
        "index": o.index, "split": o.split, "name": o.name, "n_tokens": o.n_tokens, "n_bytes": o.n_bytes,
        "key": None if fp is None else fp.key.hex(), "signature": sig, "shingles": shingles,
        "failure": o.failure, "contaminated": o.contaminated, "score": o.score,
    }  # fmt: skip


def _read_task(base: Path) -> Iterator[tuple[Outcome, np.ndarray]]:
    tokens, offset = np.load(f"{base}.npy", mmap_mode="r"), 0
    with open(f"{base}.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            fp = None
            if r["key"] is not None:
                sig, shingles = (
                    None if r[k] is None else np.frombuffer(bytes.fromhex(r[k]), np.uint32)
                    for k in ("signature", "shingles")
                )
                fp = Fingerprint(bytes.fromhex(r["key"]), sig, shingles)
            failure = tuple(r["failure"]) if r["failure"] else None
            o = Outcome(
                r["index"], r["split"], r["name"], r["n_tokens"], r["n_bytes"], fp, failure, r["contaminated"],
                score=r.get("score"),  # a task finished before --quality ran on datatrove wrote none
            )  # fmt: skip
            yield o, np.asarray(tokens[offset : offset + o.n_tokens])
            offset += o.n_tokens
