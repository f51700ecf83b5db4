"""`gptforge prepare`: tokenize a corpus in worker processes into EOT-delimited shards plus a manifest.

Shards end at document boundaries (a document longer than a shard gets one of its own), so a shard holds
whole documents and records the last one's index. `progress.json` marks the folder unfinished from the start
and saves what is done after each shard; a crashed run started again with the same settings skips finished
shards and the documents in them. Other settings replace a folder only with --force, built beside it and
swapped in once complete.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptforge.data.decontaminate import eval_ngrams, is_contaminated
from gptforge.data.shards import MANIFEST, PROGRESS, SPLITS, dtype_for_vocab, write_manifest, write_shard
from gptforge.data.sources import Document, documents, local_paths, resolve, source_bytes
from gptforge.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from gptforge.errors import GptforgeError
from gptforge.files import (
    atomic_write,
    check_output_dir,
    is_empty_dir,
    locked,
    stale_temp_files,
    swap_dir,
    temp_dir_for,
    temp_dir_path,
)

TOKENIZER_FILE = "tokenizer.json"
BATCH_DOCS, BATCH_CHARS = 256, 1 << 20  # documents per worker task, at most (a crash loses at most one batch)
# The flag behind each setting, to say which one differs from a folder's.
SETTING_FLAGS = {
    "source": "SOURCE",
    "text_field": "--text-field",
    "tokenizer": "--tokenizer/--train-tokenizer",
    "val_fraction": "--val-fraction",
    "shard_tokens": "--shard-tokens",
    "seed": "--seed",
    "decontaminate": "--decontaminate",
}
# Errors of the disk being written, not of the source being read (a network drop is not "cannot write").
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM}
# The files prepare writes (atomic_write leaves a temp file of one when killed mid-write).
OWN_FILES = "|".join(map(re.escape, (MANIFEST, PROGRESS, TOKENIZER_FILE))) + r"|(train|val)_\d+\.bin"
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


def _init_worker(tokenizer_spec: str, ngrams: frozenset[int]) -> None:
    # Ctrl-C reaches the whole process group: the parent alone stops the run, not a traceback from each worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker["tok"] = load_tokenizer(tokenizer_spec)
    _worker["ngrams"] = ngrams


def _encode(jobs: list[tuple[int, str, str]]) -> tuple[list[tuple[int, str, int, int]], np.ndarray]:
    """Tokenize a batch of documents into one array: ([(index, split, n_tokens, n_bytes)], tokens).

    Each document is EOT first, then its text, so every document (the first too) starts after a delimiter.
    Contaminated training documents get n_tokens -1 and no tokens. One array per batch, not per document,
    keeps the parent's per-document work (unpickling, bookkeeping) small enough not to cap many workers.
    """
    tok = _worker["tok"]
    docs, ids = [], []
    for index, split, text in jobs:
        if split == "train" and is_contaminated(text, _worker["ngrams"]):
            docs.append((index, split, -1, 0))
            continue
        before = len(ids)
        ids.append(tok.eot)
        ids.extend(tok.encode(text))
        docs.append((index, split, len(ids) - before, len(text.encode("utf-8"))))
    return docs, np.array(ids, dtype=dtype_for_vocab(tok.vocab_size))


def _batched(items: Iterator[tuple[int, str, str]]) -> Iterator[list[tuple[int, str, str]]]:
    batch, chars = [], 0
    for item in items:
        batch.append(item)
        chars += len(item[2])
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


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None for a missing, unreadable or malformed file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    return value if isinstance(value, dict) else None


def _tokenizer_for(
    out: Path, settings: dict[str, Any], train_vocab: int | None, resuming: bool, given: Tokenizer | None
) -> Tokenizer:
    """The `given` tokenizer (GPT-2 or a file), or a BPE trained on the training split; file-based ones go to OUT."""
    if given is None:
        if resuming and (out / TOKENIZER_FILE).is_file():
            return load_tokenizer(TOKENIZER_FILE, out)
        docs = _nonempty(documents(settings["source"], settings["text_field"]))
        train_docs = (
            text
            for i, (name, text) in enumerate(docs)
            if not is_validation(name, i, settings["val_fraction"], settings["seed"])
        )
        print(f"training a {train_vocab}-token byte-level BPE on {settings['source']}", flush=True)
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
) -> dict[str, Any]:
    """Tokenize `source` into `out_dir`; returns the manifest (also written, last, as manifest.json).

    `tokenizer` is 'gpt2' or a tokenizer .json file; `train_tokenizer=N` trains an N-token BPE instead.
    `decontaminate` lists evaluation files whose 13-grams disqualify training documents. `force` lets the
    result replace a folder holding anything else.
    """
    _check_flags(tokenizer, val_fraction, shard_tokens, workers, train_tokenizer)
    source, text_field = resolve(source, text_field)
    docs = documents(source, text_field)  # a missing source fails here, before any work
    out = Path(out_dir)
    # Never the folder read from; a folder of other files is refused before the lock file goes into it.
    holds_data = (out / MANIFEST).is_file() or (out / PROGRESS).is_file()
    tokenizer_file = [] if train_tokenizer is not None or tokenizer == "gpt2" else [tokenizer]
    check_output_dir(out, force or holds_data, [*local_paths(source), *decontaminate, *tokenizer_file])
    settings = {
        "source": source,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "seed": seed,
        "tokenizer": f"trained:{train_tokenizer}" if train_tokenizer is not None else tokenizer,
        "decontaminate": sorted(str(p) for p in decontaminate),
    }
    done = _read_json(out / MANIFEST)
    if done is not None and done.get("settings") == settings and not force:
        return _already_prepared(out, done)  # decided reading only, so a finished read-only folder works
    docs, tok, ngrams = _checked_inputs(docs, source, tokenizer, train_tokenizer, decontaminate)
    try:
        with locked(out, "prepare"):
            folder = _destination(out, settings, force)
            if folder is None:  # another prepare finished it since the check above
                return _already_prepared(out, _read_json(out / MANIFEST))
            with _marked_if_failed(folder):
                manifest = _build(
                    docs, folder, settings, given=tok, train_tokenizer=train_tokenizer, ngrams=ngrams, workers=workers
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


@contextlib.contextmanager
def _marked_if_failed(folder: Path) -> Iterator[None]:
    """An error (not a kill, Ctrl-C or full disk, which the same command resumes) marks the folder's progress.json
    failed: a corrected command with other settings may then start over there without --force."""
    try:
        yield
    except GptforgeError:
        progress = _read_json(folder / PROGRESS)
        if progress is not None:
            atomic_write(folder / PROGRESS, json.dumps({**progress, "failed": True}))
        raise


def _already_prepared(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Say so and return `manifest`, tidying what a killed run left if the folder can be written and locked."""
    print(f"{out}: already prepared with these settings", flush=True)
    with contextlib.suppress(OSError, GptforgeError), locked(out, "prepare"):  # read-only, or in use: leave it
        (out / PROGRESS).unlink(missing_ok=True)  # left by a kill between the manifest and its removal
        _remove_stale_temps(out)
    return manifest


def _remove_stale_temps(folder: Path) -> None:
    """Delete the temp files of prepare's own files that a kill -9 mid-write left; only with the lock held, so
    no other prepare is writing them."""
    for path in stale_temp_files(folder, OWN_FILES):
        path.unlink(missing_ok=True)


def _remove_own_files(folder: Path) -> None:
    """Delete the files a superseded unfinished prepare wrote (shards, tokenizer, progress); nothing else."""
    for path in folder.iterdir():
        if re.fullmatch(OWN_FILES, path.name) and path.is_file():
            path.unlink()


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


def _destination(out: Path, settings: dict[str, Any], force: bool) -> Path | None:
    """Where to build: `out` itself (empty, or an unfinished prepare to resume), a folder beside it that
    replaces it once complete (--force), or None when `out` already holds this data."""
    done, progress = _read_json(out / MANIFEST), _read_json(out / PROGRESS)
    if done is not None and done.get("settings") == settings and not force:
        return None
    if done is None and progress is not None and _resumable(progress, settings):
        return out  # resume; or start over, as nothing was written yet or that attempt failed
    if is_empty_dir(out):
        return out
    prior = done or progress
    if prior is None:
        check_output_dir(out, force)  # a folder that is not gptforge data: replaced only with --force
    elif not force:
        what = "data prepared" if done else "an unfinished prepare"
        raise GptforgeError(
            f"{out}: holds {what} with other settings ({_difference(prior.get('settings', {}), settings)}); "
            "pass --force to replace it (the old data stays until the new is complete), or pick another --out"
        )
    final = out.resolve()  # a temp folder beside '.' needs its real name
    unfinished = _read_json(temp_dir_path(final) / PROGRESS)
    if unfinished is not None and unfinished.get("settings") == settings:
        return temp_dir_path(final)  # a killed --force run resumes
    return temp_dir_for(final)


def _resumable(progress: dict[str, Any], settings: dict[str, Any]) -> bool:
    """An unfinished prepare that this one continues (same settings) or starts over: one that wrote no shard yet,
    or failed with an error (whose corrected command has other settings)."""
    return progress.get("settings") == settings or not progress.get("shards") or bool(progress.get("failed"))


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first setting that differs, as 'FLAG was OLD, now NEW'."""
    for key, flag in SETTING_FLAGS.items():
        if old.get(key) != new[key]:
            return f"{flag} was {old.get(key)!r}, now {new[key]!r}"
    return f"settings were {old!r}"


def _build(
    docs: Iterator[Document],
    out: Path,
    settings: dict[str, Any],
    given: Tokenizer | None,
    train_tokenizer: int | None,
    ngrams: frozenset[int],
    workers: int | None,
) -> dict[str, Any]:
    """Tokenize into `out`, resuming what a same-settings run saved in progress.json; returns the manifest."""
    _remove_stale_temps(out)
    progress = _read_json(out / PROGRESS)
    resuming = progress is not None and progress.get("settings") == settings
    if not resuming:  # the marker goes first: until the manifest replaces it, the folder is unfinished
        _remove_own_files(out)  # an earlier attempt's shards must not outlive it among the new ones
        atomic_write(out / PROGRESS, json.dumps({"settings": settings, "dropped_before_last_shard": 0, "shards": []}))
    tok = _tokenizer_for(out, settings, train_tokenizer, resuming, given)
    writers = {s: ShardWriter(out, s, settings["shard_tokens"], dtype_for_vocab(tok.vocab_size)) for s in SPLITS}
    dropped = 0
    if resuming and progress.get("shards"):
        for split, w in writers.items():
            w.restore([s for s in progress["shards"] if s["split"] == split])
        dropped = progress["dropped_before_last_shard"]
        print(f"resuming: {sum(len(w.shards) for w in writers.values())} shard(s) already written", flush=True)
    dropped = _tokenize(docs, tok, ngrams, writers, settings, out, workers, dropped)
    source = settings["source"]
    if writers["train"].docs == 0:
        if writers["val"].docs == 0:
            raise GptforgeError(f"{source}: empty corpus (no documents with text were found)")
        raise GptforgeError(
            f"{source}: only {writers['val'].docs} document(s), all held out for validation "
            "(add documents, or pass --val-fraction 0)"
        )
    if settings["decontaminate"]:
        print(
            f"decontamination: dropped {dropped:,} training document(s) sharing a 13-gram with "
            f"{', '.join(settings['decontaminate'])}",
            flush=True,
        )
    manifest = {
        "format": "gptforge-shards/1",
        "source": source,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot},
        "val_fraction": settings["val_fraction"],
        "seed": settings["seed"],
        "settings": settings,
        "splits": {s: {"docs": w.docs, "tokens": w.tokens, "bytes": w.bytes} for s, w in writers.items()},
        "decontamination": {"files": settings["decontaminate"], "dropped_docs": dropped},
        "shards": writers["train"].shards + writers["val"].shards,
    }
    write_manifest(out, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def _tokenize(
    docs: Iterator[Document],
    tok: Tokenizer,
    ngrams: frozenset[int],
    writers: dict[str, ShardWriter],
    settings: dict[str, Any],
    out: Path,
    workers: int | None,
    dropped: int,
) -> int:
    """Tokenize the documents not yet in a shard into the writers, saving progress after each shard; returns
    the count of training documents dropped as contaminated."""
    start = min(w.next_doc for w in writers.values())

    def jobs() -> Iterator[tuple[int, str, str]]:
        for index, (name, text) in enumerate(docs):  # documents with text (`_checked_inputs`)
            split = "val" if is_validation(name, index, settings["val_fraction"], settings["seed"]) else "train"
            if index >= start and index >= writers[split].next_doc:
                yield index, split, text

    def save_progress() -> None:
        state = {
            "settings": settings,
            "dropped_before_last_shard": dropped,
            "shards": [s for w in writers.values() for s in w.shards],
        }
        atomic_write(out / PROGRESS, json.dumps(state))

    spec = str(tok.path) if tok.path else tok.name
    source = settings["source"]
    bar = tqdm(total=source_bytes(source), desc=f"prepare {source}", unit="B", unit_scale=True, disable=None)
    with _start_pool(_worker_count(workers), spec, ngrams) as pool:
        for batch, tokens in pool.imap(_encode, _batched(jobs())):
            offset = 0
            for index, split, n_tokens, n_bytes in batch:
                if n_tokens < 0:
                    dropped += 1
                    continue
                if writers[split].add(index, tokens[offset : offset + n_tokens], n_bytes):
                    save_progress()
                offset += n_tokens
                bar.update(n_bytes)
            bar.set_postfix(
                docs=writers["train"].docs + writers["val"].docs, tokens=writers["train"].tokens, refresh=False
            )
    bar.close()
    for w in writers.values():
        w.flush()
    return dropped


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


def _start_pool(processes: int, spec: str, ngrams: frozenset[int]) -> Any:
    """A spawn pool of tokenizer workers that ignore Ctrl-C: the parent alone stops the run, ending them."""
    # Spawned while SIGINT is ignored here, the workers start out ignoring it (an ignored signal stays ignored
    # across exec, and Python leaves it so), so a Ctrl-C during their imports, before the initializer runs, cannot
    # kill one with a traceback. A Ctrl-C in the milliseconds this takes is lost; signal.signal needs the main thread.
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        return mp.get_context("spawn").Pool(processes, _init_worker, (spec, ngrams))
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
