"""Readers that yield documents as (name, text): the stdlib code corpus, local text/code/jsonl files."""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from gptforge.errors import GptforgeError

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst"}
Document = tuple[str, str]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> Iterator[Document]:
    """Every .py file of the running interpreter's standard library (site-packages excluded), sorted."""
    root = stdlib_root()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test fixtures are deliberately not UTF-8
        yield f"stdlib/{rel.as_posix()}", text


def _file_documents(path: Path, text_field: str) -> Iterator[Document]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise GptforgeError(
                        f"{path}:{lineno}: expected a JSON object with a string field {text_field!r} ({e})"
                    ) from None
                yield f"{path}:{lineno}", text
    else:
        try:
            yield str(path), path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise GptforgeError(f"{path}: expected UTF-8 text") from None


def local_documents(root: Path, text_field: str = "text") -> Iterator[Document]:
    """Documents from a file or a folder of .txt/.py/.md/.rst files (one document each) and .jsonl files."""
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | {".jsonl"})
    for path in files:
        try:
            yield from _file_documents(path, text_field)
        except PermissionError:
            raise GptforgeError(f"{path}: not readable (permission denied)") from None


def documents(source: str, text_field: str = "text") -> Iterator[Document]:
    """Dispatch a `prepare` SOURCE argument to its reader; a missing path fails here, before any work starts."""
    if source == "stdlib":
        return stdlib_documents()
    root = Path(source)
    if not root.exists():
        raise GptforgeError(f"{source}: no such file or directory (expected 'stdlib', a file or a folder)")
    return local_documents(root, text_field)
