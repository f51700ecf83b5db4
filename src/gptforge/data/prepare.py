"""`gptforge prepare`: tokenize a corpus in worker processes into EOT-delimited shards plus a manifest.

Shards end at document boundaries (a document longer than a shard gets one of its own), so a shard holds
whole documents and records the last one's index. After each shard, `progress.json` saves what is done;
a crashed run started again with the same settings skips finished shards and the documents in them.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptforge.data.decontaminate import eval_ngrams, is_contaminated
from gptforge.data.shards import MANIFEST, dtype_for_vocab, write_manifest, write_shard
from gptforge.data.sources import Document, documents, resolve, source_bytes
from gptforge.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from gptforge.errors import GptforgeError
from gptforge.files import atomic_write

TOKENIZER_FILE = "tokenizer.json"
PROGRESS = "progress.json"
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


def _init_worker(tokenizer_spec: str, ngrams: frozenset[int]) -> None:
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
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _tokenizer_for(out: Path, settings: dict[str, Any], train_vocab: int | None, resuming: bool) -> Tokenizer:
    """GPT-2, a given tokenizer file, or a BPE trained on the training split; file-based ones go to OUT."""
    if train_vocab:
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
    tok = load_tokenizer(settings["tokenizer"])
    if tok.path is not None and tok.path.resolve() != (out / TOKENIZER_FILE).resolve():
        atomic_write(out / TOKENIZER_FILE, tok.path.read_bytes())  # the data folder carries its own tokenizer
        tok = load_tokenizer(TOKENIZER_FILE, out)
    return tok


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
) -> dict[str, Any]:
    """Tokenize `source` into `out_dir`; returns the manifest (also written, last, as manifest.json).

    `tokenizer` is 'gpt2' or a tokenizer .json file; `train_tokenizer=N` trains an N-token BPE instead.
    `decontaminate` lists evaluation files whose 13-grams disqualify training documents.
    """
    source, text_field = resolve(source, text_field)
    if shard_tokens <= 0:
        raise GptforgeError(f"--shard-tokens must be positive, got {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise GptforgeError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    docs = documents(source, text_field)  # a missing source fails here, before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "source": source,
        "text_field": text_field,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "seed": seed,
        "tokenizer": f"trained:{train_tokenizer}" if train_tokenizer else tokenizer,
        "decontaminate": sorted(str(p) for p in decontaminate),
    }
    done = _read_json(out / MANIFEST)
    if done is not None and done.get("settings") == settings:
        print(f"{out}: already prepared with these settings", flush=True)
        return done
    progress = _read_json(out / PROGRESS)
    resuming = progress is not None and progress.get("settings") == settings
    tok = _tokenizer_for(out, settings, train_tokenizer, resuming)
    ngrams = eval_ngrams(decontaminate) if decontaminate else frozenset()
    writers = {s: ShardWriter(out, s, shard_tokens, dtype_for_vocab(tok.vocab_size)) for s in ("train", "val")}
    dropped = 0
    if resuming:
        for split, w in writers.items():
            w.restore([s for s in progress["shards"] if s["split"] == split])
        dropped = progress["dropped_before_last_shard"]
        print(f"resuming: {sum(len(w.shards) for w in writers.values())} shard(s) already written", flush=True)
    dropped = _tokenize(docs, tok, ngrams, writers, settings, out, workers, dropped)
    if writers["train"].docs == 0:
        if writers["val"].docs == 0:
            raise GptforgeError(f"{source}: empty corpus (no documents with text were found)")
        raise GptforgeError(
            f"{source}: only {writers['val'].docs} document(s), all held out for validation "
            "(add documents, or pass --val-fraction 0)"
        )
    if decontaminate:
        print(
            f"decontamination: dropped {dropped:,} training document(s) sharing a 13-gram with "
            f"{', '.join(settings['decontaminate'])}",
            flush=True,
        )
    manifest = {
        "format": "gptforge-shards/1",
        "source": source,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot},
        "val_fraction": val_fraction,
        "seed": seed,
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
        for index, (name, text) in enumerate(_nonempty(docs)):
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
    with mp.get_context("spawn").Pool(workers or os.cpu_count() or 1, _init_worker, (spec, ngrams)) as pool:
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


def summarize(manifest: dict[str, Any], out_dir: str | Path) -> str:
    """What `gptforge prepare` wrote, a line per split."""
    lines = [
        f"{split}: {s['docs']:,} documents, {s['tokens']:,} tokens, {s['bytes'] / 1e6:.1f} MB"
        for split, s in manifest["splits"].items()
    ]
    return "\n".join([*lines, f"wrote {len(manifest['shards'])} shard(s) and manifest.json to {out_dir}"])
