"""Token shard files in llm.c's `.bin` layout, and the `manifest.json` that describes a prepared corpus.

Layout: a header of 256 int32 (magic 20240520, version, token count, zeros) then the tokens, uint16 for
version 1 (llm.c's) or uint32 for version 2 (vocabularies over 65,535).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gptforge.errors import GptforgeError

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPES = {1: np.uint16, 2: np.uint32}
MANIFEST = "manifest.json"


def dtype_for_vocab(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def atomic_write_bytes(path: Path, chunks: list[bytes | memoryview]) -> None:
    """Write to a temp file beside `path`, fsync, then rename: readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_shard(path: Path, tokens: np.ndarray) -> str:
    """Write one shard atomically; returns the file's sha256."""
    version = {np.dtype(np.uint16): 1, np.dtype(np.uint32): 2}[tokens.dtype]
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, version, len(tokens))
    data = [header.tobytes(), memoryview(np.ascontiguousarray(tokens))]
    atomic_write_bytes(path, data)
    digest = hashlib.sha256()
    for chunk in data:
        digest.update(chunk)
    return digest.hexdigest()


def read_shard(path: Path, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map a shard, validating the header against the file size and, if given, ids against the vocab."""
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
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[version], mode="r", offset=HEADER_BYTES, shape=(count,))
    if vocab_size is not None and count and int(tokens.max()) >= vocab_size:
        raise GptforgeError(f"{path}: token id {int(tokens.max())} >= vocab size {vocab_size}")
    return tokens


def write_manifest(data_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(data_dir / MANIFEST, [json.dumps(manifest, indent=2).encode()])


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load a prepared corpus's manifest, with a clear error when the folder is not one."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise GptforgeError(f"{data_dir}: no {MANIFEST} (expected a folder written by `gptforge prepare`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise GptforgeError(f"{path}: malformed manifest ({e})") from None
    if not isinstance(manifest.get("shards"), list) or "name" not in manifest.get("tokenizer", {}):
        raise GptforgeError(f"{path}: malformed manifest (expected 'tokenizer.name' and a 'shards' list)")
    return manifest
