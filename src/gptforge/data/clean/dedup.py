"""Exact and near-duplicate detection: a hash of normalised content, and MinHash signatures with LSH banding.

Signatures are computed per document (in workers, or on many machines); the decisions are taken in one pass
over the documents in source order, so the same input keeps the same documents whatever the worker count.
The rule: a document is a duplicate of the earliest kept document it matches, which stays; a near match is
verified on the two shingle sets (their exact Jaccard), so the MinHash estimate only proposes candidates.
"""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from dataclasses import dataclass

import numpy as np

DEDUP_MODES = ("none", "exact", "near")
# A word, or a line's first word with the indentation (and any opening punctuation) before it: indentation is
# syntax in Python, so a statement moved in or out of a block changes shingles as an edited word does.
_TOKEN = re.compile(r"^[ \t]*[^\w\s]*\w+|\w+", re.MULTILINE)
_SHINGLE_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier: combines word hashes into a shingle hash
_CHUNK = 4096  # shingles per product, so a megabyte file does not need a (hashes x shingles) matrix at once
# A source file's leading comment block (a licence, mostly) is left out of its shingles when code follows it: a
# header shared by distinct short files would otherwise make them near copies. Names are languages.py's.
HASH_COMMENTED = frozenset(
    {"Python", "Cython", "Shell", "Ruby", "Perl", "R", "Julia", "Elixir", "Nim", "Makefile", "CMake", "Dockerfile",
     "Starlark", "Nix", "PowerShell"}
)  # fmt: skip
C_COMMENTED = frozenset(
    {"C", "C++", "CUDA", "Objective-C", "Go", "Rust", "Java", "Kotlin", "Scala", "Groovy", "C#", "Swift", "Dart",
     "JavaScript", "TypeScript", "Zig", "GLSL", "Protocol Buffer", "CSS", "PHP", "HCL"}
)  # fmt: skip
# Blank lines and `#` lines, each ended; a blank line's spaces include a Windows line ending's \r.
_HASH_HEADER = re.compile(r"(?:[^\S\n]*(?:#[^\n]*)?\n)+")
_C_HEADER = re.compile(r"(?:\s*(?://[^\n]*|/\*.*?\*/))+", re.DOTALL)  # `//` lines and `/* */` blocks
# A Python module's docstring, the other place a licence goes (40 short files behind one lost 39 to it), when it
# names one: a plain docstring stays, being part of what a module is (without it recall at 3% edits fell to 0.98).
DOCSTRING_HEADED = frozenset({"Python", "Cython"})
_OPENING = re.compile(r"[^\S\n]*[rRuU]?(\"\"\"|\'\'\')")
# The closing quotes, escapes skipped by a scan (a regex over the body backtracked for seconds on an unclosed one).
_CLOSING = {quote: re.compile(r"\\.|" + quote, re.DOTALL) for quote in ('"""', "'''")}
_LINE_END = re.compile(r"[^\S\n]*(?:#[^\n]*)?(?:\n|$)")  # only a comment may follow a docstring on its line
_LICENCE = re.compile(r"copyright|licen[cs]e", re.IGNORECASE)


@dataclass(frozen=True)
class DedupSettings:
    """How duplicates are found; the defaults are measured in benchmarks/dedup.py (recall and precision)."""

    mode: str = "near"
    shingle: int = 5  # words per shingle
    hashes: int = 128  # MinHash permutations
    bands: int = 32  # LSH bands (hashes / bands rows each): a pair becomes a candidate at Jaccard ~0.4
    threshold: float = 0.7  # estimated Jaccard similarity at or above which a candidate is a duplicate

    @property
    def rows(self) -> int:
        return self.hashes // self.bands


@dataclass(frozen=True)
class Fingerprint:
    """What the decision needs of one document: its exact key, its MinHash signature (None without words) and its
    distinct shingle hashes (uint32, sorted), on which a candidate pair is verified."""

    key: bytes
    signature: np.ndarray | None
    shingles: np.ndarray | None = None


def normalise(text: str) -> str:
    """Content as exact deduplication compares it: line endings, trailing spaces and blank lines at either end do
    not count; leading indentation does, even on the first line (it is syntax in Python)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # Python's line breaks, not splitlines'
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def fingerprint(text: str, settings: DedupSettings, language: str | None = None) -> Fingerprint:
    """`language` (languages.py's name, or None): whose leading comment block is left out of the shingles."""
    key = hashlib.blake2b(normalise(text).encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if settings.mode != "near":
        return Fingerprint(key, None)
    shingles = shingle_hashes(without_header(text, language), settings.shingle)
    if not len(shingles):
        return Fingerprint(key, None)
    return Fingerprint(key, _minhash(shingles, settings), _compact(shingles))


def _compact(shingles: np.ndarray) -> np.ndarray:
    """32 of each hash's bits, mixed (a 1-word shingle's hash is a crc32): half the memory for the kept documents'
    sets; a collision in a pair of 10,000-shingle files moves its Jaccard by 1e-4 about once in 40 pairs."""
    return np.unique(((shingles * _SHINGLE_BASE) >> np.uint64(32)).astype(np.uint32))


def without_header(text: str, language: str | None) -> str:
    """`text` past its leading comment block (and a Python module's docstring naming a licence, with the comments
    around it) when words follow it (a file of comments alone stays whole)."""
    pattern = _HASH_HEADER if language in HASH_COMMENTED else _C_HEADER if language in C_COMMENTED else None
    end = _end_of(pattern, text, 0)
    docstring = _docstring_end(text, end) if language in DOCSTRING_HEADED else None
    if docstring is not None and _LICENCE.search(text, end, docstring):
        end = _end_of(pattern, text, docstring)
    return text[end:] if _TOKEN.search(text, end) else text


def _docstring_end(text: str, start: int) -> int | None:
    """Where the docstring at `start` ends, past the rest of its line; None when there is none."""
    opening = _OPENING.match(text, start)
    if opening is None:
        return None
    closing = next((m for m in _CLOSING[opening.group(1)].finditer(text, opening.end()) if len(m.group()) == 3), None)
    line_end = _LINE_END.match(text, closing.end()) if closing is not None else None
    return None if line_end is None else line_end.end()


def _end_of(pattern: re.Pattern | None, text: str, start: int) -> int:
    """Where `pattern`'s match at `start` ends (`start` when none)."""
    found = pattern.match(text, start) if pattern is not None else None
    return start if found is None else found.end()


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The exact Jaccard similarity of two sorted sets of distinct shingle hashes."""
    shared = len(np.intersect1d(a, b, assume_unique=True))
    return shared / (len(a) + len(b) - shared)


def _permutations(settings: DedupSettings) -> tuple[np.ndarray, np.ndarray]:
    """Multiply-shift hash functions (a odd): fixed, so signatures agree across processes and runs."""
    rng = np.random.default_rng(1_000_003)
    a = rng.integers(1, 2**63, size=settings.hashes, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=settings.hashes, dtype=np.uint64)
    return a, b


def shingle_hashes(text: str, size: int) -> np.ndarray:
    """64-bit hashes of the distinct runs of `size` lowercase words (all the words if there are fewer); a line's
    first word carries the line's indentation."""
    words = _TOKEN.findall(text.lower())
    if not words:
        return np.zeros(0, dtype=np.uint64)
    # Each distinct word hashed once; a dict is several times faster than np.unique over a string array.
    vocab = {w: zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in dict.fromkeys(words)}
    word_hash = np.fromiter(map(vocab.__getitem__, words), dtype=np.uint64, count=len(words))
    n = max(1, len(words) - size + 1)
    h = np.zeros(n, dtype=np.uint64)
    for k in range(min(size, len(words))):
        h = h * _SHINGLE_BASE + word_hash[k : k + n] + np.uint64(1)
    return np.unique(h)


def signature(text: str, settings: DedupSettings) -> np.ndarray | None:
    """The MinHash signature (uint32 per hash function), or None for a document without words."""
    shingles = shingle_hashes(text, settings.shingle)
    return _minhash(shingles, settings) if len(shingles) else None


def _minhash(shingles: np.ndarray, settings: DedupSettings) -> np.ndarray:
    """The MinHash signature of a non-empty set of shingle hashes."""
    a, b = _permutations(settings)
    out = np.full(settings.hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
    for start in range(0, len(shingles), _CHUNK):
        part = shingles[start : start + _CHUNK]
        out = np.minimum(out, ((a[:, None] * part[None, :] + b[:, None]) >> np.uint64(32)).min(axis=1))
    return out.astype(np.uint32)


@dataclass(frozen=True)
class Verdict:
    """Why a document goes: 'exact' or 'near' duplicate of the kept document `of` (its index), with the exact
    Jaccard similarity of their shingles (1.0 for an exact copy); None from `Deduplicator.check`: kept."""

    kind: str
    of: int
    similarity: float


class Deduplicator:
    """Decides document by document, in source order, against the documents kept so far."""

    def __init__(self, settings: DedupSettings) -> None:
        self.settings = settings
        self._exact: dict[bytes, int] = {}
        self._buckets: dict[bytes, list[int]] = {}
        self._signatures: dict[int, np.ndarray] = {}
        self._shingles: dict[int, np.ndarray] = {}
        # The estimate only picks which candidates to verify: those within 4 of its standard deviations of the
        # threshold (a 128-hash estimate at 0.7: 0.16), so a pair whose estimate fell short is still verified.
        t = settings.threshold
        self._floor = t - 4 * math.sqrt(t * (1 - t) / settings.hashes)

    def check(self, index: int, fp: Fingerprint) -> Verdict | None:
        """The verdict on document `index` (a duplicate of an earlier kept one), or None: kept and remembered."""
        verdict = self.match(fp)
        if verdict is not None or self.settings.mode == "none":
            return verdict
        keys = self._band_keys(fp.signature)
        self._exact[fp.key] = index
        if fp.signature is not None:
            self._signatures[index] = fp.signature
            self._shingles[index] = fp.shingles
            for key in keys:
                self._buckets.setdefault(key, []).append(index)
        return None

    def match(self, fp: Fingerprint) -> Verdict | None:
        """The earliest kept document this one duplicates (exactly, else nearly), without remembering it."""
        if self.settings.mode == "none":
            return None
        first = self._exact.get(fp.key)
        if first is not None:
            return Verdict("exact", first, 1.0)
        return self._nearest(fp, self._band_keys(fp.signature))

    def _band_keys(self, sig: np.ndarray | None) -> list[bytes]:
        if sig is None:
            return []
        rows = self.settings.rows
        # Two bytes of band index: --dedup-bands goes up to --dedup-hashes (1024), past one byte's 256.
        return [
            band.to_bytes(2, "little") + sig[band * rows : (band + 1) * rows].tobytes()
            for band in range(self.settings.bands)
        ]

    def _nearest(self, fp: Fingerprint, keys: list[bytes]) -> Verdict | None:
        """The earliest kept candidate whose shingles' exact Jaccard similarity reaches the threshold, if any."""
        candidates = sorted({i for key in keys for i in self._buckets.get(key, ())})
        if not candidates:
            return None
        estimates = (np.stack([self._signatures[i] for i in candidates]) == fp.signature).mean(axis=1)
        for hit in np.flatnonzero(estimates >= self._floor):
            similarity = jaccard(fp.shingles, self._shingles[candidates[hit]])
            if similarity >= self.settings.threshold:
                return Verdict("near", candidates[hit], similarity)
        return None
