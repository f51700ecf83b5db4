"""Token shard files in llm.c's `.bin` layout, and the `manifest.json` that describes a prepared corpus.

Layout: a header of 256 int32 (magic 20240520, version, token count, zeros) then the tokens, uint16 for
version 1 (llm.c's) or uint32 for version 2 (vocabularies over 65,535).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptforge.errors import GptforgeError
from gptforge.files import atomic_write, write_json

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPES = {1: np.uint16, 2: np.uint32}
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
MASK_SUFFIX = ".mask.npy"
"""Present while `gptforge prepare` fills a folder: the folder is unfinished until its manifest is written."""
SPLITS = ("train", "val")


def dtype_for_vocab(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def write_shard(path: Path, tokens: np.ndarray) -> str:
    """Write one shard atomically; returns the file's sha256."""
    version = {np.dtype(np.uint16): 1, np.dtype(np.uint32): 2}[tokens.dtype]
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, version, len(tokens))
    data = [header.tobytes(), memoryview(np.ascontiguousarray(tokens))]
    atomic_write(path, data)
    digest = hashlib.sha256()
    for chunk in data:
        digest.update(chunk)
    return digest.hexdigest()


def read_shard(path: Path, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map a shard, validating the header against the file size and, if given, ids against the vocab.

    `.npy` files (build-nanogpt's shards) are read as saved: one-dimensional uint16 or uint32 arrays.
    """
    tokens = _read_npy(path) if path.suffix == ".npy" else _read_bin(path)
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise GptforgeError(f"{path}: token id {int(tokens.max())} >= vocab size {vocab_size}")
    return tokens


def write_mask(path: Path, mask: np.ndarray) -> str:
    """Write a shard's loss mask (one 0/1 byte per token, `.npy`); returns its sha256."""
    buffer = io.BytesIO()
    np.save(buffer, mask.astype(np.uint8), allow_pickle=False)
    atomic_write(path, buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def read_mask(path: Path, tokens: int) -> np.ndarray:
    """A shard's loss mask, checked to be one 0/1 byte per token."""
    try:
        mask = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise GptforgeError(f"{path}: not a readable loss mask ({e})") from None
    if mask.dtype != np.uint8 or mask.shape != (tokens,):
        raise GptforgeError(f"{path}: expected {tokens} uint8 mask values, got {mask.dtype} {mask.shape}")
    return mask


def _read_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise GptforgeError(f"{path}: not a readable .npy shard ({e})") from None
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32):
        raise GptforgeError(f"{path}: expected a 1-D uint16/uint32 token array, got {tokens.dtype} {tokens.shape}")
    return tokens


def _read_bin(path: Path) -> np.ndarray:
    try:
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS) if size >= HEADER_BYTES else None
    except OSError as e:
        raise GptforgeError(f"{path}: cannot read shard ({e.strerror})") from None
    if header is None or header[0] != MAGIC:
        raise GptforgeError(f"{path}: not a token shard (expected magic {MAGIC} in a {HEADER_BYTES}-byte header)")
    version, count = int(header[1]), int(header[2])
    if version not in TOKEN_DTYPES:
        raise GptforgeError(f"{path}: unsupported shard version {version} (expected 1 or 2)")
    itemsize = np.dtype(TOKEN_DTYPES[version]).itemsize
    if size != HEADER_BYTES + count * itemsize:
        raise GptforgeError(
            f"{path}: header says {count} tokens ({HEADER_BYTES + count * itemsize} bytes) "
            f"but the file has {size} bytes (truncated or corrupt)"
        )
    return np.memmap(path, dtype=TOKEN_DTYPES[version], mode="r", offset=HEADER_BYTES, shape=(count,))


def write_manifest(data_dir: Path, manifest: dict[str, Any]) -> None:
    write_json(data_dir / MANIFEST, manifest)


def fingerprint(manifest: dict[str, Any]) -> str:
    """What identifies a prepared corpus's content: its shards' names, sizes and checksums, hashed."""
    shards = [(s["file"], s.get("tokens"), s.get("sha256")) for s in manifest["shards"]]
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]


_verified: set[tuple[str, int, int, int, str]] = set()
"""Shards whose checksum this process has checked: (path, inode, size, mtime, sha256), so each is hashed once."""


def verify_shard(path: Path, sha256: str) -> None:
    """Refuse a shard whose bytes are not the ones `gptforge prepare` recorded (hashed once per process)."""
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, sha256)
        if key in _verified:
            return
        digest, buf = hashlib.sha256(), bytearray(1 << 20)
        with open(path, "rb") as f:
            while n := f.readinto(buf):
                digest.update(memoryview(buf)[:n])  # hashlib releases the GIL: the training threads run on
    except OSError as e:
        raise GptforgeError(f"{path}: cannot read shard ({e.strerror or e})") from None
    if digest.hexdigest() != sha256:
        raise GptforgeError(
            f"{path}: checksum mismatch (the file changed after `gptforge prepare` wrote it); "
            "prepare the data again with --force"
        )
    _verified.add(key)


def foreign_manifest(data_dir: Path) -> dict[str, Any] | None:
    """A manifest for a folder of llm.c `.bin` or build-nanogpt `.npy` GPT-2 shards ('val' in a name marks
    the validation split), or None if it has none. Without byte counts, bits per byte are unknown."""
    files = sorted(p for p in data_dir.glob("*") if p.suffix in (".bin", ".npy") and not p.name.startswith("."))
    if not files:
        return None
    shards = [
        {"file": p.name, "split": "val" if "val" in p.name else "train", "tokens": len(read_shard(p))} for p in files
    ]
    splits = {
        s: {"docs": 0, "bytes": 0, "tokens": sum(x["tokens"] for x in shards if x["split"] == s)}
        for s in ("train", "val")
    }
    gpt2 = {"name": "gpt2", "vocab_size": 50257, "eot": 50256}
    return {"format": "foreign", "source": str(data_dir), "tokenizer": gpt2, "splits": splits, "shards": shards}


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load a prepared corpus's manifest, with a clear error when the folder is not one (or not yet one)."""
    folder = Path(data_dir)
    path = folder / MANIFEST
    if not path.is_file():
        if (folder / PROGRESS).is_file():  # never read as llm.c shards: these are a prepare's first shards
            raise GptforgeError(f"{data_dir}: unfinished prepare; run `gptforge prepare` again to finish it")
        foreign = foreign_manifest(folder) if folder.is_dir() else None
        if foreign is not None:
            return foreign
        raise GptforgeError(
            f"{data_dir}: no {MANIFEST} (expected a folder written by `gptforge prepare`, or llm.c/.npy shards)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise GptforgeError(f"{path}: malformed manifest (not UTF-8 text); run `gptforge prepare` again") from None
    except json.JSONDecodeError as e:
        raise GptforgeError(f"{path}: malformed manifest ({e}); run `gptforge prepare` again") from None
    except OSError as e:
        raise GptforgeError(f"{path}: cannot read ({e.strerror or e})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise GptforgeError(f"{path}: malformed manifest ({problem}); run `gptforge prepare` again")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """The first thing the readers need that `manifest` lacks, or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, expected an object"
    tok = manifest.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("name"), str):
        return "no 'tokenizer.name'"
    if not isinstance(tok.get("vocab_size"), int) or tok["vocab_size"] <= 0:
        return f"'tokenizer.vocab_size' is {tok.get('vocab_size')!r}, expected a positive integer"
    chat = manifest.get("chat")  # a chat folder (prepare --chat): its template's tokens and a loss mask per shard
    tokens = chat.get("special_tokens") if isinstance(chat, dict) else None
    if chat and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        return f"'chat' is {chat!r}, expected an object with a 'special_tokens' list"
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return "no 'shards' list"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
            return f"shards[{i}] has no 'file'"
        if chat and not isinstance(shard.get("mask"), str):
            return f"shards[{i}] has no 'mask' (a chat folder's loss mask file)"
        if shard.get("split") not in SPLITS:
            return f"shards[{i}].split is {shard.get('split')!r}, expected 'train' or 'val'"
        if not isinstance(shard.get("sha256", ""), str):
            return f"shards[{i}].sha256 is not a string"
    splits = manifest.get("splits")
    for split in sorted({s["split"] for s in shards}):
        counts = splits.get(split) if isinstance(splits, dict) else None
        if not (isinstance(counts, dict) and all(isinstance(counts.get(k), int) for k in ("tokens", "bytes"))):
            return f"no 'splits.{split}' with 'tokens' and 'bytes'"
    return None


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
