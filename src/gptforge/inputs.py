"""Reading the user's files: UTF-8 text, gunzipped on the fly, and JSONL records with the 'file:line' that
messages name; each way a read can fail is one GptforgeError naming the file."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import stat
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from gptforge.errors import GptforgeError


def open_text(path: str | Path, errors: str = "strict", newline: str | None = None) -> TextIO:
    """A UTF-8 text file, gunzipped on the fly when it ends in .gz; a leading byte order mark is dropped. With
    errors="surrogateescape" a byte that is not UTF-8 reads as a lone surrogate (`not_utf8` names it); `newline` is
    open()'s (None: \\r, \\n and \\r\\n end a line, read as \\n)."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", errors=errors, newline=newline)
    return open(path, encoding="utf-8-sig", errors=errors, newline=newline)


def open_jsonl(path: str | Path, errors: str = "strict") -> TextIO:
    """`open_text` for JSONL: a line ends at \\n alone. A bare \\r is JSON whitespace, which universal newlines took
    for a line break; a \\r\\n's \\r stays on its line, as whitespace."""
    return open_text(path, errors, newline="\n")


_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(path: str | Path) -> str:
    """`path` as text that UTF-8 files, JSON, TOML and HTTP can carry: a byte of a name that is not UTF-8 (which
    Python reads as a lone surrogate) is written as backslashreplace shows it, 'caf\\xe9.py'."""
    return _SURROGATE.sub(_escaped, os.fsdecode(path))


def _escaped(match: re.Match) -> str:
    char = ord(match[0])
    return f"\\x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"\\u{char:04x}"


@contextlib.contextmanager
def utf8_path(path: str | Path) -> Iterator[str]:
    """`path` as a name that libraries taking UTF-8 paths only (safetensors, tokenizers) can open: one that is not
    UTF-8 is reached through a link from a temporary folder."""
    name = os.fspath(path)
    if not_utf8(name) is None:
        yield name
        return
    with tempfile.TemporaryDirectory(prefix="gptforge-") as folder:
        link = os.path.join(folder, "link")
        os.symlink(os.path.abspath(name), link)
        yield link


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


def not_utf8(text: str) -> str | None:
    """Why `text` is not valid UTF-8 (a byte that is not, read as a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"a lone surrogate U+{char:04X}"
        return f"not valid UTF-8 text ({what} at character {e.start + 1})"
    return None


def parse_json(text: str | bytes) -> Any:
    """json.loads, each way it fails a ValueError whose message is the reason in our words (Python's own wording
    for an integer past 4,300 digits names sys.set_int_max_str_digits)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    except UnicodeDecodeError:
        raise ValueError("not JSON: not UTF-8 text") from None
    except ValueError:
        raise ValueError("not JSON: an integer of more than 4,300 digits") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def read_jsonl(path: str | Path, torn_tail_ok: bool = False) -> Iterator[tuple[str, Any]]:
    """(where, record) for each non-blank line of a jsonl[.gz] file; `where` is 'file:line' for messages.

    `torn_tail_ok` skips a last line that is not JSON and has no newline: what a crash mid-append leaves.
    """
    with reading(path), open_jsonl(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = parse_json(line)
            except ValueError as e:
                if torn_tail_ok and not line.endswith("\n"):
                    return
                raise GptforgeError(f"{where}: {e}") from None
            yield where, record


def require_regular_file(path: str | Path, flag: str) -> Path:
    """`path` when it is a regular file (or a link to one); one line for a FIFO, device or folder, which would
    block or never end when read whole."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise GptforgeError(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise GptforgeError(f"{flag} {path}: not a regular file (expected a file to read)")
    return path
