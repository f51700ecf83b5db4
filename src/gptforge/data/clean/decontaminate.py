"""Drop training documents that share a 13-gram of words with evaluation data (the GPT-3 practice).

Words are lowercased runs of Unicode letters and digits (any script), so punctuation and spacing differences do
not hide an overlap.
N-grams are kept as 64-bit BLAKE2b hashes: stable across processes (Python's `hash` is salted per process)
and with a negligible false-positive rate at millions of n-grams.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from gptforge.inputs import format_suffix, read_jsonl, read_text, require_regular_file

N = 13
_WORD = re.compile(r"[^\W_]+")  # \w without the underscore: snake_case splits as before, any script is words


def _hashes(text: str, n: int = N) -> Iterator[int]:
    words = _WORD.findall(text.lower())
    for i in range(len(words) - n + 1):
        digest = hashlib.blake2b(" ".join(words[i : i + n]).encode(), digest_size=8).digest()
        yield int.from_bytes(digest, "little")


def _strings(value) -> Iterator[str]:
    """Every string inside a JSON value (HellaSwag's ctx and endings, HumanEval's prompt and solution...)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _eval_texts(path: Path) -> Iterator[str]:
    if format_suffix(path) != ".jsonl":
        yield read_text(path)
        return
    for _, record in read_jsonl(path):
        yield from _strings(record)


def eval_ngrams(paths: Iterable[str | Path]) -> frozenset[int]:
    """The 13-gram hashes of evaluation files (.jsonl[.gz]: every string field of every record; else all text);
    a FIFO or device is refused (it would block or never end), a file without any 13-gram is warned of."""
    found: set[int] = set()
    for path in paths:
        path = require_regular_file(path, "--decontaminate")
        before = len(found)
        found.update(h for text in _eval_texts(path) for h in _hashes(text))
        if len(found) == before:
            print(f"warning: --decontaminate {path}: no text of {N} words or more, so it removes nothing", flush=True)
    return frozenset(found)


def is_contaminated(text: str, ngrams: frozenset[int]) -> bool:
    return bool(ngrams) and any(h in ngrams for h in _hashes(text))
