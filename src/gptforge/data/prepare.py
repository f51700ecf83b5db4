"""`gptforge prepare`: tokenize a corpus in worker processes into EOT-delimited shards plus a manifest.

Shards end at document boundaries (a document longer than a shard gets one of its own), so a shard holds
whole documents and records the last one's index. `progress.json` marks the folder unfinished from the start
and saves what is done after each shard; a crashed run started again with the same settings skips finished
shards and the documents in them. Other settings replace a folder only with --force, built beside it and
swapped in once complete.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptforge.data.decontaminate import eval_ngrams, is_contaminated
from gptforge.data.dedup import DEDUP_MODES, Deduplicator, DedupSettings, fingerprint
from gptforge.data.filters import Filter, build_filters, clean_settings, first_failure
from gptforge.data.languages import DEFAULT_EXTENSIONS, language_of, parse_extensions
from gptforge.data.outdir import (
    REPORT_FILE,
    TOKENIZER_FILE,
    WRITE_ERRNOS,
    already_prepared,
    destination,
    finished,
    marked_if_failed,
    read_json,
    remove_own_files,
    remove_stale_temps,
)
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.report import Report, render
from gptforge.data.shards import MANIFEST, PROGRESS, SPLITS, dtype_for_vocab, write_manifest, write_shard
from gptforge.data.sources import Document, documents, local_paths, resolve, source_bytes
from gptforge.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, check_output_dir, locked, swap_dir

BATCH_DOCS, BATCH_CHARS = 256, 1 << 20  # documents per worker task, at most (a crash loses at most one batch)
_worker: dict[str, Any] = {}


@dataclass
class ShardWriter:
    """One split's shards: buffers whole documents and writes a shard once `shard_tokens` are reached."""

    out_dir: Path
    split: str
    shard_tokens: int
    dtype: type
    shards: list[dict[str, Any]] = field(default_factory=list)
    docs: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._fill = self._docs = self._bytes = 0
        self._last = -1

    @property
    def next_doc(self) -> int:
        """Index of the first document not in a written shard."""
        return self.shards[-1]["last_doc"] + 1 if self.shards else 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._fill

    def restore(self, shards: list[dict[str, Any]]) -> None:
        self.shards = list(shards)
        self.docs = sum(s["docs"] for s in shards)
        self.bytes = sum(s["bytes"] for s in shards)

    def add(self, index: int, tokens: np.ndarray, n_bytes: int) -> bool:
        """Buffer a document; True if a shard was written."""
        flushed = False
        if self._fill and self._fill + len(tokens) > self.shard_tokens:
            flushed = self.flush()
        self._parts.append(tokens)
        self._fill += len(tokens)
        self._docs, self._bytes, self._last = self._docs + 1, self._bytes + n_bytes, index
        self.docs, self.bytes = self.docs + 1, self.bytes + n_bytes
        if self._fill >= self.shard_tokens:
            flushed = self.flush()
        return flushed

    def flush(self) -> bool:
        if not self._fill:
            return False
        name = f"{self.split}_{len(self.shards):06d}.bin"
        sha = write_shard(self.out_dir / name, np.concatenate(self._parts))
        self.shards.append(
            {
                "file": name,
                "split": self.split,
                "tokens": self._fill,
                "sha256": sha,
                "docs": self._docs,
                "bytes": self._bytes,
                "last_doc": self._last,
            }
        )
        self._parts, self._fill, self._docs, self._bytes = [], 0, 0, 0
        return True


def _init_worker(tokenizer_spec: str, ngrams: frozenset[int], filters: list[Filter], dedup: DedupSettings) -> None:
    # Ctrl-C reaches the whole process group: the parent alone stops the run, not a traceback from each worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(tok=load_tokenizer(tokenizer_spec), ngrams=ngrams, filters=filters, dedup=dedup)


Job = tuple[int, str, str, str, bool]  # (index, split, name, text, tokenize it: False for one already in a shard)


def _encode(jobs: list[Job]) -> tuple[list[tuple], np.ndarray]:
    """Judge and tokenize a batch of documents: ([(index, split, name, n_tokens, n_bytes, fingerprint, failure,
    contaminated)], tokens), the tokens of all in one array.

    The worker does what is per document (filters, dedup fingerprint, contamination, tokens); the parent decides
    duplicates in document order. A filtered or contaminated document, or one not to tokenize, gets no tokens;
    each tokenized one is EOT first, then its text. One array per batch keeps the parent's work small.
    """
    tok, dedup = _worker["tok"], _worker["dedup"]
    docs, ids = [], []
    for index, split, name, text, tokenize in jobs:
        failure = first_failure(_worker["filters"], text, language_of(name))
        fp = fingerprint(text, dedup) if dedup.mode != "none" and failure is None else None
        contaminated = failure is None and split == "train" and is_contaminated(text, _worker["ngrams"])
        before = len(ids)
        if tokenize and failure is None and not contaminated:
            ids.append(tok.eot)
            ids.extend(tok.encode(text))
        docs.append((index, split, name, len(ids) - before, len(text.encode("utf-8")), fp, failure, contaminated))
    return docs, np.array(ids, dtype=dtype_for_vocab(tok.vocab_size))


def _batched(items: Iterator[Job]) -> Iterator[list[Job]]:
    batch, chars = [], 0
    for item in items:
        batch.append(item)
        chars += len(item[3]) if item[4] else len(item[3]) // 8  # fingerprinting alone is cheaper
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


def _nonempty(docs: Iterator[Document]) -> Iterator[Document]:
    return (d for d in docs if d[1].strip())


def _tokenizer_for(
    out: Path, settings: PrepareSettings, train_vocab: int | None, resuming: bool, given: Tokenizer | None
) -> Tokenizer:
    """The `given` tokenizer (GPT-2 or a file), or a BPE trained on the training split; file-based ones go to OUT."""
    if given is None:
        if resuming and (out / TOKENIZER_FILE).is_file():
            return load_tokenizer(TOKENIZER_FILE, out)
        docs = _nonempty(documents(settings.source, settings.text_field, extensions=settings.extensions))
        train_docs = (
            text
            for i, (name, text) in enumerate(docs)
            if not is_validation(name, i, settings.val_fraction, settings.seed)
        )
        print(f"training a {train_vocab}-token byte-level BPE on {settings.source}", flush=True)
        return train_bpe(train_docs, train_vocab, out / TOKENIZER_FILE)
    if given.path is not None and given.path.resolve() != (out / TOKENIZER_FILE).resolve():
        atomic_write(out / TOKENIZER_FILE, given.path.read_bytes())  # the data folder carries its own tokenizer
        return load_tokenizer(TOKENIZER_FILE, out)
    return given


def prepare(
    source: str,
    out_dir: str | Path,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.01,
    shard_tokens: int = 100_000_000,
    workers: int | None = None,
    text_field: str | None = None,
    train_tokenizer: int | None = None,
    decontaminate: list[str] = (),
    seed: int = 0,
    force: bool = False,
    dedup: str | DedupSettings = "near",
    clean: str = "none",
    clean_set: Sequence[str] = (),
    ext: str | None = None,
) -> dict[str, Any]:
    """Tokenize `source` into `out_dir`; returns the manifest (also written, last, as manifest.json).

    `tokenizer` is 'gpt2' or a tokenizer .json file; `train_tokenizer=N` trains an N-token BPE instead.
    `decontaminate` lists evaluation files whose 13-grams disqualify training documents. `force` lets the
    result replace a folder holding anything else. `dedup` is a mode (none, exact, near) or its settings;
    `clean` a filter set (none, code, web) and `clean_set` its changes ('code.max_line_length=2000');
    `ext` the file types read from a folder or glob (languages.parse_extensions; default: source and text).
    """
    _check_flags(tokenizer, val_fraction, shard_tokens, workers, train_tokenizer)
    dedup = check_dedup(DedupSettings(mode=dedup) if isinstance(dedup, str) else dedup)
    build_filters(clean)  # an unknown mode fails here
    cleaning = clean_settings(clean_set)
    source, text_field = resolve(source, text_field)
    extensions = parse_extensions(ext) if ext is not None else DEFAULT_EXTENSIONS
    skipped: list[tuple[str, int]] = []  # binary files, filled as the documents are read
    docs = documents(source, text_field, extensions=extensions, skipped=skipped)  # a missing source fails here
    out = Path(out_dir)
    # Never the folder read from; a folder of other files is refused before the lock file goes into it.
    holds_data = (out / MANIFEST).is_file() or (out / PROGRESS).is_file()
    tokenizer_file = [] if train_tokenizer is not None or tokenizer == "gpt2" else [tokenizer]
    check_output_dir(out, force or holds_data, [*local_paths(source), *decontaminate, *tokenizer_file])
    settings = PrepareSettings(
        source=source,
        text_field=text_field,
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
        seed=seed,
        tokenizer=f"trained:{train_tokenizer}" if train_tokenizer is not None else tokenizer,
        decontaminate=tuple(sorted(str(p) for p in decontaminate)),
        dedup=dedup,
        clean_mode=clean,
        clean=cleaning,
        ext=tuple(sorted(extensions)) if extensions != DEFAULT_EXTENSIONS else None,
    )
    done = finished(out, settings)
    if done is not None and not force:
        return already_prepared(out, done, locked)  # decided reading only, so a finished read-only folder works
    docs, tok, ngrams = _checked_inputs(docs, source, tokenizer, train_tokenizer, decontaminate)
    try:
        with locked(out, "prepare"):
            folder = destination(out, settings, force)
            if folder is None:  # another prepare finished it since the check above
                return already_prepared(out, read_json(out / MANIFEST), locked)
            with marked_if_failed(folder):
                manifest = _build(
                    (docs, skipped),
                    folder,
                    settings,
                    given=tok,
                    train_tokenizer=train_tokenizer,
                    ngrams=ngrams,
                    workers=workers,
                )
            if folder != out:
                swap_dir(folder, out.resolve())
            return manifest
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise GptforgeError(
            f"cannot write {out}: {e.strerror}; fix that and run the same command again (it resumes)"
        ) from None


def _checked_inputs(
    docs: Iterator[Document], source: str, tokenizer: str, train_tokenizer: int | None, decontaminate: list[str]
) -> tuple[Iterator[Document], Tokenizer | None, frozenset[int]]:
    """The documents with text (the first one read), the given tokenizer and the evaluation n-grams: a wrong
    --tokenizer, --decontaminate or --text-field, or a corpus without text, fails before the folder exists."""
    tok = load_tokenizer(tokenizer) if train_tokenizer is None else None
    ngrams = eval_ngrams(decontaminate) if decontaminate else frozenset()
    docs = _nonempty(docs)
    first = next(docs, None)
    if first is None:
        raise GptforgeError(f"{source}: empty corpus (no documents with text were found)")
    return itertools.chain([first], docs), tok, ngrams


def check_dedup(settings: DedupSettings) -> DedupSettings:
    """The --dedup settings, or one line naming the flag whose value cannot work."""
    if settings.mode not in DEDUP_MODES:
        raise GptforgeError(f"--dedup {settings.mode!r}: expected one of {', '.join(DEDUP_MODES)}")
    if not 0 < settings.threshold <= 1:
        raise GptforgeError(f"--dedup-threshold must be in (0, 1], got {settings.threshold}")
    for flag, value in (("--dedup-shingle", settings.shingle), ("--dedup-hashes", settings.hashes)):
        if value < 1:
            raise GptforgeError(f"{flag} must be positive, got {value}")
    if settings.bands < 1 or settings.hashes % settings.bands:
        raise GptforgeError(
            f"--dedup-bands {settings.bands}: expected a positive divisor of --dedup-hashes {settings.hashes}"
        )
    return settings


def _check_flags(
    tokenizer: str, val_fraction: float, shard_tokens: int, workers: int | None, train_tokenizer: int | None
) -> None:
    """Refuse values that would fail late or silently (--train-tokenizer 0 used to mean GPT-2)."""
    if shard_tokens <= 0:
        raise GptforgeError(f"--shard-tokens must be positive, got {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise GptforgeError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if workers is not None and workers <= 0:
        raise GptforgeError(f"--workers must be positive, got {workers}")
    if train_tokenizer is not None and not 257 <= train_tokenizer <= 2**32:
        raise GptforgeError(f"--train-tokenizer {train_tokenizer}: expected a vocabulary size of at least 257")
    if train_tokenizer is not None and tokenizer != "gpt2":
        raise GptforgeError(f"--tokenizer {tokenizer} and --train-tokenizer {train_tokenizer}: pass one of them")


def _build(
    read: tuple[Iterator[Document], list[tuple[str, int]]],
    out: Path,
    settings: PrepareSettings,
    given: Tokenizer | None,
    train_tokenizer: int | None,
    ngrams: frozenset[int],
    workers: int | None,
) -> dict[str, Any]:
    """Tokenize into `out`, resuming what a same-settings run saved in progress.json; returns the manifest."""
    remove_stale_temps(out)
    progress = read_json(out / PROGRESS)
    resuming = progress is not None and settings.matches(progress.get("settings"))
    if not resuming:  # the marker goes first: until the manifest replaces it, the folder is unfinished
        remove_own_files(out)  # an earlier attempt's shards must not outlive it among the new ones
        atomic_write(out / PROGRESS, json.dumps({"settings": settings.to_json(), "shards": []}))
    tok = _tokenizer_for(out, settings, train_tokenizer, resuming, given)
    writers = {s: ShardWriter(out, s, settings.shard_tokens, dtype_for_vocab(tok.vocab_size)) for s in SPLITS}
    if resuming and progress.get("shards"):
        for split, w in writers.items():
            w.restore([s for s in progress["shards"] if s["split"] == split])
        print(f"resuming: {sum(len(w.shards) for w in writers.values())} shard(s) already written", flush=True)
    docs, skipped = read
    report = _tokenize(docs, tok, ngrams, writers, settings, out, workers)
    for _, n_bytes in skipped:
        report.count("binary skipped", n_bytes)
    _check_kept(settings, writers, report)
    if settings.decontaminate:
        print(
            f"decontamination: dropped {report.docs['decontaminated']:,} training document(s) sharing a 13-gram "
            f"with {', '.join(settings.decontaminate)}",
            flush=True,
        )
    manifest = {
        "format": "gptforge-shards/1",
        "source": settings.source,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot},
        "val_fraction": settings.val_fraction,
        "seed": settings.seed,
        "settings": settings.to_json(),
        "splits": {s: {"docs": w.docs, "tokens": w.tokens, "bytes": w.bytes} for s, w in writers.items()},
        "decontamination": {"files": list(settings.decontaminate), "dropped_docs": report.docs["decontaminated"]},
        "report": report.to_json(),
        "shards": writers["train"].shards + writers["val"].shards,
    }
    atomic_write(out / REPORT_FILE, render(manifest["report"], manifest["settings"]))
    write_manifest(out, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def _check_kept(settings: PrepareSettings, writers: dict[str, ShardWriter], report: Report) -> None:
    """One line when nothing is left to train on: the filter that removed most, or why the corpus is empty."""
    source = settings.source
    if writers["train"].docs:
        return
    if report.filters and not writers["val"].docs:
        rule, (n, _) = max(report.filters.items(), key=lambda item: item[1][0])
        counts = ", ".join(f"{name} {d:,}" for name, (d, _) in report.filters.items())
        raise GptforgeError(
            f"{source}: --clean {settings.clean_mode} removed every document (filter {rule} removed {n:,} of "
            f"{report.docs['read']:,}; {counts}); relax it with --clean-set or pass --clean none"
        )
    if writers["val"].docs == 0:
        raise GptforgeError(f"{source}: empty corpus (no documents with text were found)")
    raise GptforgeError(
        f"{source}: only {writers['val'].docs} document(s) kept, all held out for validation "
        "(add documents, or pass --val-fraction 0)"
    )


def _tokenize(
    docs: Iterator[Document],
    tok: Tokenizer,
    ngrams: frozenset[int],
    writers: dict[str, ShardWriter],
    settings: PrepareSettings,
    out: Path,
    workers: int | None,
) -> Report:
    """Judge every document in order and tokenize those kept that are not yet in a shard into the writers,
    saving progress after each shard. Documents already in shards are judged again (not tokenized), so the
    deduplicator and the report are rebuilt exactly on resume."""

    def jobs() -> Iterator[Job]:
        for index, (name, text) in enumerate(docs):  # documents with text (`_checked_inputs`)
            split = "val" if is_validation(name, index, settings.val_fraction, settings.seed) else "train"
            yield index, split, name, text, index >= writers[split].next_doc

    def save_progress() -> None:
        state = {"settings": settings.to_json(), "shards": [s for w in writers.values() for s in w.shards]}
        atomic_write(out / PROGRESS, json.dumps(state))

    spec = str(tok.path) if tok.path else tok.name
    filters = build_filters(settings.clean_mode, settings.clean)
    dedup, report, names = Deduplicator(settings.dedup), Report(), {}
    bar = tqdm(
        total=source_bytes(settings.source), desc=f"prepare {settings.source}", unit="B", unit_scale=True, disable=None
    )
    with _start_pool(_worker_count(workers), spec, ngrams, filters, settings.dedup) as pool:
        for batch, tokens in pool.imap(_encode, _batched(jobs())):
            offset = 0
            for outcome in batch:
                index, split, _, n_tokens, n_bytes = outcome[:5]
                kept = _judge(outcome, dedup, report, names) and n_tokens
                if kept and writers[split].add(index, tokens[offset : offset + n_tokens], n_bytes):
                    save_progress()
                offset += n_tokens
                bar.update(n_bytes)
            bar.set_postfix(
                docs=writers["train"].docs + writers["val"].docs, tokens=writers["train"].tokens, refresh=False
            )
    bar.close()
    for w in writers.values():
        w.flush()
    return report


def _judge(outcome: tuple, dedup: Deduplicator, report: Report, names: dict[int, str]) -> bool:
    """Whether a document is kept, in the stated order: filters, then duplicates of an earlier kept document
    (decided here, in document order, whatever the worker count), then contamination; counted in `report`."""
    index, _, name, _, n_bytes, fp, failure, contaminated = outcome
    language = language_of(name)
    report.read(language, n_bytes)
    if failure is not None:
        report.filter_removed(name, *failure, n_bytes)
        return False
    verdict = dedup.check(index, fp) if fp is not None else None
    if verdict is not None:
        report.duplicate(verdict.kind, name, names.get(verdict.of, "?"), verdict.similarity, n_bytes)
        return False
    if dedup.settings.mode != "none":
        names[index] = name  # a kept document: a later duplicate names it
    if contaminated:
        report.count("decontaminated", n_bytes)
        return False
    report.kept(language, n_bytes)
    return True


def _cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one: taskset, containers)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _worker_count(workers: int | None) -> int:
    """--workers, at most one per CPU (default: one per CPU): more only compete for the same cores."""
    cpus = _cpu_count()
    if workers is not None and workers > cpus:
        print(f"using {cpus} workers: this machine has {cpus} CPUs", flush=True)
        return cpus
    return workers or cpus


def _start_pool(processes: int, spec: str, ngrams: frozenset[int], filters: list[Filter], dedup: DedupSettings) -> Any:
    """A spawn pool of tokenizer workers that ignore Ctrl-C: the parent alone stops the run, ending them."""
    # Spawned while SIGINT is ignored here, the workers start out ignoring it (an ignored signal stays ignored
    # across exec, and Python leaves it so), so a Ctrl-C during their imports, before the initializer runs, cannot
    # kill one with a traceback. A Ctrl-C in the milliseconds this takes is lost; signal.signal needs the main thread.
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        return mp.get_context("spawn").Pool(processes, _init_worker, (spec, ngrams, filters, dedup))
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def summarize(manifest: dict[str, Any], out_dir: str | Path) -> str:
    """What `gptforge prepare` wrote, a line per split."""
    lines = [
        f"{split}: {s['docs']:,} documents, {s['tokens']:,} tokens, {s['bytes'] / 1e6:.1f} MB"
        for split, s in manifest["splits"].items()
    ]
    return "\n".join([*lines, f"wrote {len(manifest['shards'])} shard(s) and manifest.json to {out_dir}"])
