"""Exact and MinHash near-duplicate decisions: which documents go, which stays, and that signatures are stable."""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np

from gptforge.data.dedup import Deduplicator, DedupSettings, fingerprint, signature

NEAR = DedupSettings()


def code_file(seed: int, lines: int = 60) -> str:
    rng = random.Random(seed)
    names = [f"name{rng.randrange(10**6)}" for _ in range(40)]
    return "\n".join(
        f"def {rng.choice(names)}({rng.choice(names)}, {rng.choice(names)}):  return {rng.choice(names)} + {i}"
        for i in range(lines)
    )


def change_lines(text: str, fraction: float, seed: int) -> str:
    rng = random.Random(seed)
    lines = text.splitlines()
    for i in rng.sample(range(len(lines)), max(1, round(fraction * len(lines)))):
        lines[i] = f"changed_{rng.randrange(10**9)} = {rng.randrange(10**9)}"
    return "\n".join(lines)


def verdicts(texts: list[str], settings: DedupSettings = NEAR) -> list:
    dedup = Deduplicator(settings)
    return [dedup.check(i, fingerprint(t, settings)) for i, t in enumerate(texts)]


def test_exact_copies_differing_in_line_endings_and_trailing_space_go_and_the_first_stays():
    a = code_file(1)
    copy = "\n\n" + a.replace("\n", "   \r\n") + "\n\n"
    out = verdicts([a, code_file(2), copy], DedupSettings(mode="exact"))
    assert out[:2] == [None, None]
    assert (out[2].kind, out[2].of) == ("exact", 0)


def test_a_copy_with_a_few_lines_changed_is_a_near_duplicate_and_distinct_files_are_kept():
    originals = [code_file(s) for s in range(20)]
    copies = [change_lines(t, 0.03, seed=s) for s, t in enumerate(originals)]
    far = [change_lines(t, 0.5, seed=s) for s, t in enumerate(originals)]
    out = verdicts(originals + copies + far)
    assert out[:20] == [None] * 20
    assert [(v.kind, v.of) for v in out[20:40]] == [("near", i) for i in range(20)]
    assert out[40:] == [None] * 20  # half the lines changed: different files
    assert verdicts(originals + copies, DedupSettings(mode="exact"))[20:] == [None] * 20
    assert verdicts(originals + originals, DedupSettings(mode="none"))[20:] == [None] * 20


def test_a_duplicate_of_several_kept_documents_names_the_earliest():
    base = code_file(7, lines=100)
    a, b = change_lines(base, 0.02, seed=1), change_lines(base, 0.02, seed=2)
    out = verdicts([code_file(3), a, code_file(4), b, base])
    assert out[3].of == 1 and out[4].of == 1  # b is a copy of a; base matches a (kept), not b (gone)


def test_documents_without_words_are_compared_exactly_only():
    out = verdicts(["+++", "+++", "---"])
    assert out[0] is None and out[1].kind == "exact" and out[2] is None


def test_the_estimated_similarity_follows_the_true_jaccard():
    a, b = code_file(11, lines=200), code_file(12, lines=200)
    mixed = "\n".join(a.splitlines()[:100] + b.splitlines()[:100])  # shares about a third of the shingles with a
    estimate = float((signature(a, NEAR) == signature(mixed, NEAR)).mean())
    assert 0.2 < estimate < 0.5


def _signature_in_child(text: str) -> np.ndarray:
    return signature(text, NEAR)


def test_signatures_are_the_same_in_another_process():
    text = code_file(5)
    with mp.get_context("spawn").Pool(1) as pool:
        theirs = pool.apply(_signature_in_child, (text,))
    np.testing.assert_array_equal(theirs, signature(text, NEAR))
