"""prepare's per-document stages: what worker processes compute for each document (filters, dedup fingerprint,
contamination, tokens), and the parent's decision on each, in document order (`judge`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gptforge.data.clean.decontaminate import is_contaminated
from gptforge.data.clean.dedup import Deduplicator, DedupSettings, fingerprint
from gptforge.data.clean.filters import Filter, first_failure
from gptforge.data.clean.quality import Classifier
from gptforge.data.languages import language_of
from gptforge.data.report import Report
from gptforge.data.shards import dtype_for_vocab
from gptforge.tokens.tokenizer import load_tokenizer

BATCH_DOCS, BATCH_CHARS = 256, 1 << 20  # documents per worker task, at most (a crash loses at most one batch)
_worker: dict[str, Any] = {}


@dataclass(frozen=True)
class Job:
    """A document for a worker: `tokenize` is False for one already in a shard (or when only judging)."""

    index: int
    split: str
    name: str
    text: str
    tokenize: bool


@dataclass(frozen=True)
class Outcome:
    """What a worker found for a document; its tokens (`n_tokens` of them) are in the batch's token array."""

    index: int
    split: str
    name: str
    n_tokens: int
    n_bytes: int
    fingerprint: Any  # dedup.fingerprint's, or None when not de-duplicating or filtered
    failure: tuple[str, str] | None  # (filter, reason) of the first filter that removes it
    contaminated: bool
    score: float | None = None  # the quality classifier's, for a document the filters kept (None: no classifier)


def init_worker(
    spec: str | None, ngrams: frozenset[int], filters: list[Filter], dedup: DedupSettings, quality: Classifier | None
) -> None:
    # Ctrl-C reaches the whole process group: the parent alone stops the run, not a traceback from each worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    load_worker(spec, ngrams, filters, dedup, quality=quality)


def load_worker(
    spec: str | None, ngrams: frozenset[int], filters: list[Filter], dedup: DedupSettings, *, quality=None
) -> None:
    """What `encode` uses in this process: the tokenizer (None: judging only), n-grams, filters, dedup settings
    and the quality classifier (None: none)."""
    _worker.update(
        tok=load_tokenizer(spec) if spec else None, ngrams=ngrams, filters=filters, dedup=dedup, quality=quality
    )


def encode(jobs: list[Job]) -> tuple[list[Outcome], np.ndarray]:
    """Judge and tokenize a batch of documents: their outcomes, and the tokens of all in one array.

    The worker does what is per document; the parent decides duplicates in document order. A filtered or
    contaminated document, or one not to tokenize, gets no tokens; each tokenized one is EOT first, then its text.
    One array per batch keeps the parent's work small.
    """
    tok, dedup, quality = _worker["tok"], _worker["dedup"], _worker.get("quality")
    failures = [first_failure(_worker["filters"], job.text, language_of(job.name)) for job in jobs]
    passed = [job.text for job, failure in zip(jobs, failures, strict=True) if failure is None]
    scores = iter(quality.scores(passed) if quality is not None else [None] * len(passed))
    outcomes, ids = [], []
    for job, failure in zip(jobs, failures, strict=True):
        score = next(scores) if failure is None else None
        fp = fingerprint(job.text, dedup, language_of(job.name)) if dedup.mode != "none" and failure is None else None
        contaminated = failure is None and job.split == "train" and is_contaminated(job.text, _worker["ngrams"])
        before = len(ids)
        # The quality verdict is a function of the score and the name alone: one judge removes needs no tokens.
        unwanted = score is not None and not quality.keeps(score, job.name)
        if job.tokenize and failure is None and not contaminated and not unwanted:
            ids.append(tok.eot)
            ids.extend(tok.encode(job.text))
        n_bytes = len(job.text.encode("utf-8"))
        outcomes.append(
            Outcome(job.index, job.split, job.name, len(ids) - before, n_bytes, fp, failure, contaminated, score)
        )
    return outcomes, np.array(ids, dtype=dtype_for_vocab(tok.vocab_size) if tok else np.uint16)


def nonempty(
    docs: Iterator[tuple[str, str]], skipped: list[tuple[str, int, str]] | None = None
) -> Iterator[tuple[str, str]]:
    """The documents with text; blank ones go to `skipped` as (name, bytes, 'empty'), so the report counts them."""
    for name, text in docs:
        if text.strip():
            yield name, text
        elif skipped is not None:
            skipped.append((name, len(text.encode("utf-8", "surrogatepass")), "empty"))


def batched(jobs: Iterator[Job]) -> Iterator[list[Job]]:
    batch, chars = [], 0
    for job in jobs:
        batch.append(job)
        chars += len(job.text) if job.tokenize else len(job.text) // 8  # fingerprinting alone is cheaper
        if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def is_validation(name: str, index: int, val_fraction: float, seed: int = 0) -> bool:
    """Held-out split by a stable hash of the document name; the first document always, so val is never empty."""
    if val_fraction <= 0:
        return False
    key = f"{seed}:{name}" if seed else name  # seed 0 hashes the bare name
    return index == 0 or zlib.crc32(key.encode()) % 1_000_000 < val_fraction * 1_000_000


def judge(
    outcome: Outcome, dedup: Deduplicator, report: Report, names: dict[int, str], *, quality: Classifier | None = None
) -> bool:
    """Whether a document is kept, in the stated order: filters, the quality classifier (GPT-3's order: before
    de-duplication), contamination, then duplicates of an earlier kept document (decided here, in document order,
    whatever the worker count); counted in `report`."""
    index, name, n_bytes = outcome.index, outcome.name, outcome.n_bytes
    language = language_of(name)
    report.read(language, n_bytes)
    if outcome.failure is not None:
        report.filter_removed(name, *outcome.failure, n_bytes)
        return False
    if quality is not None:
        kept = quality.keeps(outcome.score, name)
        report.scored(name, outcome.score, kept, n_bytes)
        if not kept:
            return False
    if outcome.contaminated:  # before de-duplication: a removed document is no later copy's kept one
        report.decontaminated(name, n_bytes)
        return False
    verdict = dedup.check(index, outcome.fingerprint) if outcome.fingerprint is not None else None
    if verdict is not None:
        report.duplicate(verdict.kind, name, names.get(verdict.of, "?"), verdict.similarity, n_bytes)
        return False
    if dedup.settings.mode != "none":
        names[index] = name  # a kept document: a later duplicate names it
    report.kept(language, n_bytes)
    return True


def cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one: taskset, containers)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_count(workers: int | None) -> int:
    """--workers, at most one per CPU (default: one per CPU): more only compete for the same cores."""
    cpus = cpu_count()
    if workers is not None and workers > cpus:
        print(f"using {cpus} workers: this machine has {cpus} CPUs", flush=True)
        return cpus
    return workers or cpus


def start_pool(
    processes: int,
    spec: str | None,
    ngrams: frozenset[int],
    filters: list[Filter],
    dedup: DedupSettings,
    quality: Classifier | None = None,
) -> Any:
    """A spawn pool of tokenizer workers that ignore Ctrl-C: the parent alone stops the run, ending them."""
    # Spawned while SIGINT is ignored here, the workers start out ignoring it (an ignored signal stays ignored
    # across exec, and Python leaves it so), so a Ctrl-C during their imports, before the initializer runs, cannot
    # kill one with a traceback. A Ctrl-C in the milliseconds this takes is lost; signal.signal needs the main thread.
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        return mp.get_context("spawn").Pool(processes, init_worker, (spec, ngrams, filters, dedup, quality))
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
