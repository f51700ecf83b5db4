"""Exact and near-duplicate detection: a hash of normalised content, and MinHash signatures with LSH banding.

Signatures are computed per document (in workers, or on many machines); the decisions are taken in one pass
over the documents in source order, so the same input keeps the same documents whatever the worker count.
The rule: a document is a duplicate of the earliest kept document it matches, which stays.
"""

from __future__ import annotations

import hashlib
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
    """What the decision needs of one document: its exact key, and its MinHash signature (None without words)."""

    key: bytes
    signature: np.ndarray | None


def normalise(text: str) -> str:
    """Content as exact deduplication compares it: line endings, trailing spaces and blank lines at either end do
    not count; leading indentation does, even on the first line (it is syntax in Python)."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # Python's line breaks, not splitlines'
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def fingerprint(text: str, settings: DedupSettings) -> Fingerprint:
    key = hashlib.blake2b(normalise(text).encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if settings.mode != "near":
        return Fingerprint(key, None)
    return Fingerprint(key, signature(text, settings))


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
    if not len(shingles):
        return None
    a, b = _permutations(settings)
    out = np.full(settings.hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
    for start in range(0, len(shingles), _CHUNK):
        part = shingles[start : start + _CHUNK]
        out = np.minimum(out, ((a[:, None] * part[None, :] + b[:, None]) >> np.uint64(32)).min(axis=1))
    return out.astype(np.uint32)


@dataclass(frozen=True)
class Verdict:
    """Why a document goes: 'exact' or 'near' duplicate of the kept document `of` (its index), with the
    estimated similarity; None from `Deduplicator.check` means the document is kept."""

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

    def check(self, index: int, fp: Fingerprint) -> Verdict | None:
        """The verdict on document `index` (a duplicate of an earlier kept one), or None: kept and remembered."""
        verdict = self.match(fp)
        if verdict is not None or self.settings.mode == "none":
            return verdict
        keys = self._band_keys(fp.signature)
        self._exact[fp.key] = index
        if fp.signature is not None:
            self._signatures[index] = fp.signature
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
        return self._nearest(fp.signature, self._band_keys(fp.signature))

    def _band_keys(self, sig: np.ndarray | None) -> list[bytes]:
        if sig is None:
            return []
        rows = self.settings.rows
        # Two bytes of band index: --dedup-bands goes up to --dedup-hashes (1024), past one byte's 256.
        return [
            band.to_bytes(2, "little") + sig[band * rows : (band + 1) * rows].tobytes()
            for band in range(self.settings.bands)
        ]

    def _nearest(self, sig: np.ndarray | None, keys: list[bytes]) -> Verdict | None:
        """The earliest kept document whose estimated Jaccard similarity reaches the threshold, if any."""
        candidates = sorted({i for key in keys for i in self._buckets.get(key, ())})
        if not candidates:
            return None
        similar = (np.stack([self._signatures[i] for i in candidates]) == sig).mean(axis=1)
        hits = np.flatnonzero(similar >= self.settings.threshold)
        if not len(hits):
            return None
        return Verdict("near", candidates[hits[0]], float(similar[hits[0]]))
