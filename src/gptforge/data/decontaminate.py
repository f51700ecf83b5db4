"""Drop training documents that share a 13-gram of words with evaluation data (the GPT-3 practice).

Words are lowercase alphanumeric runs, so punctuation and spacing differences do not hide an overlap.
N-grams are kept as 64-bit BLAKE2b hashes: stable across processes (Python's `hash` is salted per process)
and with a negligible false-positive rate at millions of n-grams.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from gptforge.files import format_suffix, read_jsonl, read_text

N = 13
_WORD = re.compile(r"[a-z0-9]+")


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
    """The 13-gram hashes of evaluation files (.jsonl[.gz]: every string field of every record; else all text)."""
    return frozenset(h for p in paths for text in _eval_texts(Path(p)) for h in _hashes(text))


def is_contaminated(text: str, ngrams: frozenset[int]) -> bool:
    return bool(ngrams) and any(h in ngrams for h in _hashes(text))
