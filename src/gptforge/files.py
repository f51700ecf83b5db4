"""Writing so that nothing is ever half-written: a file (`atomic_write`) or a folder (`building_dir`, `swap_dir`)
appears whole or not at all; append-only logs (`append_jsonl`) can lose at most their last line.

Checkpoints and exports write their files with their own libraries (safetensors, torch.save) into a temporary
folder from here, which is swapped in only once complete. Also the shared readers `open_text` and `read_jsonl`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from gptforge.errors import GptforgeError


def atomic_write(path: str | Path, data: str | bytes | Iterable[bytes | memoryview]) -> Path:
    """Write to a temp file beside `path`, fsync, then rename: readers see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    chunks = [data.encode()] if isinstance(data, str) else [data] if isinstance(data, bytes) else data
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, value: Any) -> Path:
    return atomic_write(path, json.dumps(value, indent=2))


def temp_dir_path(final: Path) -> Path:
    """Where `final`'s replacement is built: a hidden folder beside it, so the rename stays on one filesystem."""
    return final.with_name(f".{final.name}.tmp")


def temp_dir_for(final: Path) -> Path:
    """A fresh `temp_dir_path(final)` (a crash's leftover is cleared)."""
    tmp = temp_dir_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _refuse_non_folder(final: Path) -> None:
    if final.exists() and not final.is_dir():
        raise GptforgeError(f"{final}: exists and is not a folder (expected a folder to write or replace)")


def swap_dir(tmp: Path, final: Path) -> Path:
    """Put the complete folder `tmp` at `final`; an old `final` is moved aside first and deleted only after."""
    _refuse_non_folder(final)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


@contextlib.contextmanager
def building_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temp folder to fill; on success it replaces `final` with `swap_dir`, on error it is removed."""
    final = Path(final)
    _refuse_non_folder(final)  # before any work, and never replace a file with a folder
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_for(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_dir(tmp, final)


def open_text(path: str | Path) -> TextIO:
    """A UTF-8 text file, gunzipped on the fly when it ends in .gz."""
    path = Path(path)
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def format_suffix(path: str | Path) -> str:
    """The format suffix, looking through .gz: 'a.jsonl.gz' -> '.jsonl'."""
    path = Path(path)
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Turn each way a text file can fail to read into one GptforgeError that names it."""
    try:
        yield
    except UnicodeDecodeError:
        raise GptforgeError(f"{path}: expected UTF-8 text") from None
    except (gzip.BadGzipFile, EOFError, zlib.error):
        raise GptforgeError(f"{path}: corrupt or truncated gzip file") from None
    except OSError as e:
        raise GptforgeError(f"{path}: cannot read ({e.strerror or e})") from None


def read_text(path: str | Path) -> str:
    with reading(path), open_text(path) as f:
        return f.read()


def read_jsonl(path: str | Path, torn_tail_ok: bool = False) -> Iterator[tuple[str, Any]]:
    """(where, record) for each non-blank line of a jsonl[.gz] file; `where` is 'file:line' for messages.

    `torn_tail_ok` skips a last line that is not JSON and has no newline: what a crash mid-append leaves.
    """
    with reading(path), open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if torn_tail_ok and not line.endswith("\n"):
                    return
                raise GptforgeError(f"{where}: not JSON ({e})") from None
            yield where, record


def append_jsonl(path: str | Path, record: Any) -> None:
    """Add one line to an append-only log (metrics, samples): a crash can cut only the line being written."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
