"""The prose rules behind `--clean web`: each a function (text, language, settings) -> reason or None.

Gopher (arXiv:2112.11446 App. A, Table A1), C4 (Raffel et al. 2020 §2.2) and FineWeb: thresholds and semantics
as datatrove implements them (GopherQualityFilter, GopherRepetitionFilter, C4QualityFilter,
FineWebQualityFilter). Where we differ (words are regex runs, not spaCy tokens; C4 counts lines, it does not
edit them), the rule's docstring says so. Shared per-document statistics are cached on the text (maxsize 1).
"""

from __future__ import annotations

import functools
import re
from itertools import compress, repeat
from typing import Any

import numpy as np

_PROSE = frozenset({"prose"})


def _n(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:,.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# Words are runs of letters and digits (a regex's \w+), and each run of other non-space characters is one
# token more (a tokenizer splits punctuation off, and keeps '...' or '###' whole); the ratios that datatrove
# takes over spaCy's tokens (symbols per word, words with a letter, line breaks per word) take them over both.
_ASCII_RUNS = re.compile(r"[\x00-\x7f]+")
_ASCII_WORD = {c for c in range(128) if chr(c).isalnum() or c == ord("_")}
# Translation tables over UTF-8: punctuation to spaces, leaving words (multi-byte characters untouched); and
# punctuation to 'p', everything else to spaces, leaving the symbol runs.
_WORD_VIEW = bytes(c if c in _ASCII_WORD or c >= 128 else ord(" ") for c in range(256))
_SYMBOL_VIEW = bytes(ord(" ") if c in _ASCII_WORD or c >= 128 or chr(c).isspace() else ord("p") for c in range(256))
_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})  # Gopher's
_BULLETS = ("•", "-")
_ELLIPSES = ("...", "…")
# Sentence-final marks of the common scripts (a subset of Unicode's Sentence_Terminal, as FineWeb uses).
_TERMINAL = (".", "!", "?", "。", "！", "？", "．", "‼", "⁇", "⁈", "⁉", "‽", "۔", "؟", "।", "॥", "።", "။")
_C4_END = (".", "?", "!", '"', "'")
_C4_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]’”]*(?=\s|$)")
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier combining word hashes into n-gram hashes


@functools.lru_cache(maxsize=1)
def _words(text: str) -> tuple[list[str], int]:
    r"""The words, and the number of tokens (words and symbol runs). The same as `re.findall(r"\w+")` and
    counting `[^\w\s]+`, three times faster: non-ASCII punctuation becomes '~' and non-ASCII space ' ' (a few
    distinct characters, each one fast replace), and bytes.translate does the rest."""
    if not text.isascii():
        for char in set(_ASCII_RUNS.sub("", text)):
            if not char.isalnum():
                text = text.replace(char, " " if char.isspace() else "~")
    data = text.encode("utf-8", "surrogatepass")
    symbols = data.translate(_SYMBOL_VIEW)
    words = data.translate(_WORD_VIEW).decode("utf-8", "surrogatepass").split()
    return words, len(words) + symbols.count(b" p") + symbols.startswith(b"p")


@functools.lru_cache(maxsize=1)
def _nonblank_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


def _repeats(items: list[str]) -> tuple[int, int]:
    """How many items repeat an earlier one, and their characters."""
    unique = set(items)
    return len(items) - len(unique), sum(map(len, items)) - sum(map(len, unique))


def gopher_word_count(text: str, language: str | None, s: Any) -> str | None:
    n = len(_words(text)[0])
    if n < s.min_words:
        return f"{_n(n)} words < {_n(s.min_words)}"
    return f"{_n(n)} words > {_n(s.max_words)}" if n > s.max_words else None


def gopher_word_length(text: str, language: str | None, s: Any) -> str | None:
    words = _words(text)[0]
    mean = sum(map(len, words)) / max(1, len(words))
    if mean < s.min_mean_word_length:
        return f"mean word length {_n(mean)} < {_n(s.min_mean_word_length)}"
    return f"mean word length {_n(mean)} > {_n(s.max_mean_word_length)}" if mean > s.max_mean_word_length else None


def gopher_symbol_ratio(text: str, language: str | None, s: Any) -> str | None:
    tokens = max(1, _words(text)[1])
    for symbol, count in (("'#'", text.count("#")), ("ellipses", text.count("...") + text.count("…"))):
        if count / tokens > s.max_symbol_word_ratio:
            return f"{symbol} per word {_n(count / tokens)} > {_n(s.max_symbol_word_ratio)}"
    return None


def gopher_bullet_lines(text: str, language: str | None, s: Any) -> str | None:
    lines = text.splitlines() or [""]
    frac = sum(map(str.startswith, map(str.lstrip, lines), repeat(_BULLETS))) / len(lines)
    return (
        f"{_pct(frac)} of lines start with a bullet > {_pct(s.max_bullet_lines)}" if frac > s.max_bullet_lines else None
    )


def gopher_ellipsis_lines(text: str, language: str | None, s: Any) -> str | None:
    lines = text.splitlines() or [""]
    frac = sum(map(str.endswith, map(str.rstrip, lines), repeat(_ELLIPSES))) / len(lines)
    limit = s.max_ellipsis_lines
    return f"{_pct(frac)} of lines end with an ellipsis > {_pct(limit)}" if frac > limit else None


def gopher_alpha_words(text: str, language: str | None, s: Any) -> str | None:
    words, tokens = _words(text)
    frac = (len(words) - sum(map(str.isdecimal, words))) / max(1, tokens)
    return f"{_pct(frac)} of words hold a letter < {_pct(s.min_alpha_words)}" if frac < s.min_alpha_words else None


def gopher_stop_words(text: str, language: str | None, s: Any) -> str | None:
    found = len(STOP_WORDS.intersection(_words(text)[0]))
    return f"{found} distinct stop words < {s.min_stop_words}" if found < s.min_stop_words else None


def gopher_dup_lines(text: str, language: str | None, s: Any) -> str | None:
    lines = _nonblank_lines(text)
    count, chars = _repeats(lines)
    if count > s.max_dup_lines * len(lines):
        return f"{_pct(count / len(lines))} of lines repeat > {_pct(s.max_dup_lines)}"
    frac = chars / max(1, len(text))
    return (
        f"repeated lines hold {_pct(frac)} of chars > {_pct(s.max_dup_line_chars)}"
        if frac > s.max_dup_line_chars
        else None
    )


def gopher_dup_paragraphs(text: str, language: str | None, s: Any) -> str | None:
    paragraphs = _PARAGRAPH_BREAK.split(text.strip())
    count, chars = _repeats(paragraphs)
    if count > s.max_dup_paragraphs * len(paragraphs):
        return f"{_pct(count / len(paragraphs))} of paragraphs repeat > {_pct(s.max_dup_paragraphs)}"
    frac, limit = chars / max(1, len(text)), s.max_dup_paragraph_chars
    return f"repeated paragraphs hold {_pct(frac)} of chars > {_pct(limit)}" if frac > limit else None


@functools.lru_cache(maxsize=1)
def _ngram_chars(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """Characters in the commonest word n-gram (n = 2..4, joined by spaces, times its count) and in the
    repeats of n-grams after their first occurrence (n = 5..10, overlaps counted once), as Gopher defines them.

    An n-gram occurs twice only where its (n-1)-gram prefix and suffix do, so each n looks only at those
    positions: ordinary text leaves few, and the cost is about one sort of the words."""
    words = _words(text)[0]
    top, dup = dict.fromkeys(range(2, 5), 0), dict.fromkeys(range(5, 11), 0)
    if len(words) < 2:
        return top, dup
    ids = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
    hashes, where, repeats = ids, np.arange(len(words) - 1), np.zeros(len(words), dtype=bool)
    for n in range(2, min(10, len(words)) + 1):
        hashes = hashes[:-1] * _MIX + ids[n - 1 :]  # the n-gram starting at each position
        if n > 2:  # the n-grams that can repeat start where the (n-1)-grams at i and i + 1 both repeat
            repeats[:] = False
            repeats[where] = True
            where = where[repeats[where + 1]]
        if not len(where):
            top.update({m: len(" ".join(words[:m])) for m in range(n, 5) if m <= len(words)})
            break
        first, counts, group = _groups(hashes[where])
        if n < 5:
            best = int(counts.max())
            start = int(where[first[counts == best].min()]) if best > 1 else 0
            top[n] = best * len(" ".join(words[start : start + n]))
        else:
            later = where[first[group] != np.arange(len(where))]
            if len(later):
                covered = np.cumsum(
                    np.bincount(later, minlength=len(words) + 1) - np.bincount(later + n, minlength=len(words) + 1)
                )
                dup[n] = sum(map(len, compress(words, (covered[:-1] > 0).tolist())))
        where = where[counts[group] > 1]
    return top, dup


def _groups(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For equal values: each group's first index and size, and each value's group (np.unique, trimmed)."""
    order = np.argsort(values)
    ordered = values[order]
    new = np.empty(len(values), dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    sizes = np.empty(len(starts), dtype=np.intp)
    sizes[:-1] = starts[1:] - starts[:-1]
    sizes[-1] = len(values) - starts[-1]
    group = np.empty(len(values), dtype=np.intp)
    group[order] = np.cumsum(new) - 1
    return np.minimum.reduceat(order, starts), sizes, group


def gopher_top_ngrams(text: str, language: str | None, s: Any) -> str | None:
    top = _ngram_chars(text)[0]
    for n, limit in ((2, s.max_top_2gram), (3, s.max_top_3gram), (4, s.max_top_4gram)):
        if top[n] > limit * len(text):
            return f"the commonest {n}-gram holds {_pct(top[n] / len(text))} of chars > {_pct(limit)}"
    return None


def gopher_dup_ngrams(text: str, language: str | None, s: Any) -> str | None:
    dup = _ngram_chars(text)[1]
    for n in range(5, 11):
        limit = getattr(s, f"max_dup_{n}gram")
        if dup[n] > limit * len(text):
            return f"repeated {n}-grams hold {_pct(dup[n] / len(text))} of chars > {_pct(limit)}"
    return None


@functools.lru_cache(maxsize=1)
def _c4(text: str, s: Any) -> str | int:
    """C4's line loop: 'lorem ipsum' or 'curly brace' when a counted line drops the page, else the sentences
    in counted lines (C4 also deletes the other lines; we keep documents whole). Sentences end at .!? before
    a space, where C4 used NLTK's Punkt; counting stops at the minimum when nothing later can drop the page."""
    may_drop = "{" in text or "lorem ipsum" in text.lower()
    sentences = 0
    for raw in text.splitlines():
        line = raw.strip()
        words = line.split()
        if max(map(len, words), default=0) > s.c4_max_word_length:
            continue
        if s.c4_terminal_punctuation:
            line = _C4_CITATION.sub("", line)
            if not line.endswith(_C4_END) or line.endswith("..."):
                continue
        if len(words) < s.c4_min_words_per_line:
            continue
        lowered = line.lower()
        if "lorem ipsum" in lowered:
            return "lorem ipsum"
        if "javascript" in lowered or any(p in lowered for p in _C4_POLICY):
            continue
        if "{" in line:
            return "curly brace"
        sentences += len(_SENTENCE_END.findall(line)) + (not line.endswith(_TERMINAL))
        if sentences >= s.c4_min_sentences and not may_drop:
            break
    return sentences


def c4_lorem_ipsum(text: str, language: str | None, s: Any) -> str | None:
    return "'lorem ipsum' placeholder text" if _c4(text, s) == "lorem ipsum" else None


def c4_curly_brace(text: str, language: str | None, s: Any) -> str | None:
    return "a '{' in a counted line: code or markup, not prose" if _c4(text, s) == "curly brace" else None


def c4_sentences(text: str, language: str | None, s: Any) -> str | None:
    found = _c4(text, s)
    if isinstance(found, int) and found < s.c4_min_sentences:
        return f"{found} sentences in lines C4 counts < {s.c4_min_sentences}"
    return None


def fineweb_line_punctuation(text: str, language: str | None, s: Any) -> str | None:
    lines = _nonblank_lines(text) or [""]
    frac = sum(map(str.endswith, map(str.rstrip, lines), repeat(_TERMINAL))) / len(lines)
    limit = s.min_line_punctuation
    return f"{_pct(frac)} of lines end in punctuation < {_pct(limit)}" if frac < limit else None


def fineweb_short_lines(text: str, language: str | None, s: Any) -> str | None:
    lines = _nonblank_lines(text) or [""]
    frac = sum(map(s.short_line_length.__ge__, map(len, lines))) / len(lines)
    limit = s.max_short_lines
    return f"{_pct(frac)} of lines <= {s.short_line_length} chars > {_pct(limit)}" if frac > limit else None


def fineweb_list_ratio(text: str, language: str | None, s: Any) -> str | None:
    ratio = text.count("\n") / max(1, _words(text)[1])
    limit = s.max_newlines_per_word
    return f"{_n(ratio)} line breaks per word > {_n(limit)}" if ratio > limit else None


def fineweb_dup_line_chars(text: str, language: str | None, s: Any) -> str | None:
    chars = _repeats(_nonblank_lines(text))[1]
    frac = chars / max(1, len(text) - text.count("\n"))
    limit = s.max_dup_line_chars_fineweb
    return f"repeated lines hold {_pct(frac)} of chars > {_pct(limit)}" if frac > limit else None


# Gopher's quality rules, C4's, FineWeb's, then the repetition rules (the dearest) last.
WEB_RULES = (
    ("web.gopher_word_count", gopher_word_count, _PROSE),
    ("web.gopher_word_length", gopher_word_length, _PROSE),
    ("web.gopher_symbol_ratio", gopher_symbol_ratio, _PROSE),
    ("web.gopher_bullet_lines", gopher_bullet_lines, _PROSE),
    ("web.gopher_ellipsis_lines", gopher_ellipsis_lines, _PROSE),
    ("web.gopher_alpha_words", gopher_alpha_words, _PROSE),
    ("web.gopher_stop_words", gopher_stop_words, _PROSE),
    ("web.c4_lorem_ipsum", c4_lorem_ipsum, _PROSE),
    ("web.c4_curly_brace", c4_curly_brace, _PROSE),
    ("web.c4_sentences", c4_sentences, _PROSE),
    ("web.fineweb_line_punctuation", fineweb_line_punctuation, _PROSE),
    ("web.fineweb_short_lines", fineweb_short_lines, _PROSE),
    ("web.fineweb_list_ratio", fineweb_list_ratio, _PROSE),
    ("web.gopher_dup_lines", gopher_dup_lines, _PROSE),
    ("web.gopher_dup_paragraphs", gopher_dup_paragraphs, _PROSE),
    ("web.fineweb_dup_line_chars", fineweb_dup_line_chars, _PROSE),
    ("web.gopher_top_ngrams", gopher_top_ngrams, _PROSE),
    ("web.gopher_dup_ngrams", gopher_dup_ngrams, _PROSE),
)
