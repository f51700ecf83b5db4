"""Decontamination's unit: a shared run of 13 words, no fewer, marks a training document."""

import json

import pytest

from gptforge.data.clean.decontaminate import eval_ngrams, is_contaminated

DOC = " ".join(f"word{i}" for i in range(40))  # distinct words: no run repeats elsewhere in the document


@pytest.mark.parametrize(("shared", "contaminated"), [(12, False), (13, True), (14, True)])
@pytest.mark.parametrize("start", [0, 10, 40 - 14])
def test_an_overlap_of_13_words_is_removed_and_of_12_kept(tmp_path, shared, contaminated, start):
    """The shared run sits at the start, in the middle or at the end of the document, between other eval words."""
    run = DOC.split()[start : start + shared]
    evals = tmp_path / "evals.jsonl"
    evals.write_text(json.dumps({"ctx": f"before {' '.join(run).upper()}, after", "label": 0}) + "\n")
    assert is_contaminated(DOC, eval_ngrams([evals])) is contaminated


def test_an_eval_text_of_exactly_13_words_is_one_ngram(tmp_path):
    evals = tmp_path / "evals.txt"
    evals.write_text(" ".join(DOC.split()[27:40]))  # the document's last 13 words and nothing else
    assert len(eval_ngrams([evals])) == 1 and is_contaminated(DOC, eval_ngrams([evals]))
    assert not is_contaminated(" ".join(DOC.split()[28:40]), eval_ngrams([evals]))


def test_words_of_any_script_count_and_a_file_without_ngrams_is_warned_of(tmp_path, capsys):
    import os

    from gptforge.errors import GptforgeError

    greek = " ".join(f"λέξη{chr(0x3B1 + i)}" for i in range(20))
    evals, short = tmp_path / "evals.txt", tmp_path / "short.txt"
    evals.write_text(greek.upper())
    short.write_text("too short to matter")
    assert is_contaminated(f"πριν {greek} μετά", eval_ngrams([evals]))
    assert "short.txt: no text of 13 words" not in capsys.readouterr().out
    assert not eval_ngrams([short]) and "short.txt: no text of 13 words" in capsys.readouterr().out
    os.mkfifo(tmp_path / "ff.jsonl")
    with pytest.raises(GptforgeError, match="--decontaminate .*ff.jsonl: not a regular file"):
        eval_ngrams([tmp_path / "ff.jsonl"])
