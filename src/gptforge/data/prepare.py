"""`gptforge prepare`: tokenize a corpus in worker processes into EOT-delimited shards plus a manifest."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from gptforge.data.shards import dtype_for_vocab, write_manifest, write_shard
from gptforge.data.sources import Document, documents
from gptforge.errors import GptforgeError
from gptforge.tokenizer import Tokenizer, load_tokenizer, train_bpe

TOKENIZER_FILE = "tokenizer.json"
_worker_tokenizer = None


@dataclass
class ShardWriter:
    """Buffers one split's tokens and writes a shard each time `shard_tokens` are full (bounded memory)."""

    out_dir: Path
    split: str
    shard_tokens: int
    dtype: type
    shards: list[dict[str, Any]] = field(default_factory=list)
    docs: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        self._buf = np.empty(self.shard_tokens, dtype=self.dtype)
        self._fill = 0

    def add(self, tokens: np.ndarray, n_bytes: int) -> None:
        self.docs += 1
        self.bytes += n_bytes
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self._fill)
            self._buf[self._fill : self._fill + take] = tokens[:take]
            self._fill += take
            tokens = tokens[take:]
            if self._fill == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        name = f"{self.split}_{len(self.shards):06d}.bin"
        sha = write_shard(self.out_dir / name, self._buf[: self._fill])
        self.shards.append({"file": name, "split": self.split, "tokens": self._fill, "sha256": sha})
        self._fill = 0

    def close(self) -> None:
        if self._fill:
            self._flush()

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._fill


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_name)


def _encode(doc: Document) -> tuple[str, np.ndarray, int]:
    """EOT first, then the document: every document (the first too) starts after a delimiter."""
    name, text = doc
    tok = _worker_tokenizer
    ids = np.array([tok.eot, *tok.encode(text)], dtype=dtype_for_vocab(tok.vocab_size))
    return name, ids, len(text.encode("utf-8"))


def is_validation(name: str, index: int, val_fraction: float) -> bool:
    """Held-out split by a stable hash of the document name; the first document always, so val is never empty."""
    if val_fraction <= 0:
        return False
    return index == 0 or zlib.crc32(name.encode()) % 1_000_000 < val_fraction * 1_000_000


def _nonempty(docs: Iterator[Document]) -> Iterator[Document]:
    return (d for d in docs if d[1].strip())


def _tokenizer_for(
    source: str, out: Path, tokenizer: str, train_vocab: int | None, val_fraction: float, text_field: str
) -> Tokenizer:
    """GPT-2, a given tokenizer file, or a BPE trained on the training split; file-based ones go to OUT."""
    if train_vocab:
        train_docs = (
            text
            for i, (name, text) in enumerate(_nonempty(documents(source, text_field)))
            if not is_validation(name, i, val_fraction)
        )
        print(f"training a {train_vocab}-token byte-level BPE on {source}", flush=True)
        return train_bpe(train_docs, train_vocab, out / TOKENIZER_FILE)
    tok = load_tokenizer(tokenizer)
    if tok.path is not None and tok.path.resolve() != (out / TOKENIZER_FILE).resolve():
        shutil.copyfile(tok.path, out / TOKENIZER_FILE)  # the data folder carries its own tokenizer
        tok = load_tokenizer(TOKENIZER_FILE, out)
    return tok


def prepare(
    source: str,
    out_dir: str | Path,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.01,
    shard_tokens: int = 100_000_000,
    workers: int | None = None,
    text_field: str = "text",
    train_tokenizer: int | None = None,
) -> dict[str, Any]:
    """Tokenize `source` into `out_dir`; returns the manifest (also written, last, as manifest.json).

    `tokenizer` is 'gpt2' or a tokenizer .json file; `train_tokenizer=N` trains an N-token BPE instead.
    """
    if shard_tokens <= 0:
        raise GptforgeError(f"--shard-tokens must be positive, got {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise GptforgeError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    docs = documents(source, text_field)  # a missing source fails here, before any work
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer_for(source, out, tokenizer, train_tokenizer, val_fraction, text_field)
    spec = str(tok.path) if tok.path else tok.name
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(out, s, shard_tokens, dtype) for s in ("train", "val")}
    workers = workers or os.cpu_count() or 1
    start = time.perf_counter()
    total_bytes = 0
    bar = tqdm(desc=f"prepare {source}", unit=" docs", dynamic_ncols=True, disable=None)  # off unless a TTY
    with mp.get_context("spawn").Pool(workers, _init_worker, (spec,)) as pool:
        for index, (name, ids, n_bytes) in enumerate(pool.imap(_encode, _nonempty(docs), 16)):
            split = "val" if is_validation(name, index, val_fraction) else "train"
            writers[split].add(ids, n_bytes)
            total_bytes += n_bytes
            bar.update()
            if index % 64 == 0:
                mb_s = total_bytes / 1e6 / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(tokens=f"{writers['train'].tokens + writers['val'].tokens:,}", MB_s=f"{mb_s:.1f}")
    bar.close()
    for w in writers.values():
        w.close()
    if writers["train"].docs == 0:
        if writers["val"].docs == 0:
            raise GptforgeError(f"{source}: empty corpus (no documents with text were found)")
        raise GptforgeError(
            f"{source}: only {writers['val'].docs} document(s), all held out for validation "
            "(add documents, or pass --val-fraction 0)"
        )
    manifest = {
        "format": "gptforge-shards/1",
        "source": source,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot},
        "val_fraction": val_fraction,
        "splits": {s: {"docs": w.docs, "tokens": w.tokens, "bytes": w.bytes} for s, w in writers.items()},
        "shards": writers["train"].shards + writers["val"].shards,
    }
    write_manifest(out, manifest)
    return manifest
