"""prepare --quality: GPT-3's classifier keeps documents like the reference's, by a seeded per-document rule."""

import dataclasses
import json
import random
import string
import sys

import numpy as np
import pytest

import gptforge.data.pipeline as pipeline
from gptforge.cli import main
from gptforge.data.clean import quality
from gptforge.data.clean.quality import Classifier, QualitySettings
from gptforge.data.engine import EngineSettings
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.errors import GptforgeError

NOUNS = ["total", "average", "count", "largest", "names", "scores", "items", "words", "lines", "prices", "ages"]
VERBS = ["compute", "collect", "find", "load", "parse", "render", "merge", "filter", "update", "check"]


def _function(seed: int) -> str:
    """A readable Python function, different for each seed."""
    rng = random.Random(seed)
    verb, noun, other = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(NOUNS)
    k = rng.randint(2, 9)
    return (
        f"def {verb}_{noun}(values, limit={k}):\n"
        f'    """Return the {noun} of the values below the limit, as {other}."""\n'
        f"    result = []\n"
        f"    for value in values:\n"
        f"        if value < limit:\n"
        f"            result.append(value * {k})\n"
        f"    return result\n"
    )


def _garbage(seed: int) -> str:
    """A minified or random line: what a quality classifier should score low."""
    rng = random.Random(seed)
    return "".join(rng.choices(string.ascii_letters + string.digits + ";{}()=+-*/%$#@!", k=400)) + "\n"


def _folders(tmp_path, n_ref=30, n_real=20, n_junk=20):
    ref, corpus = tmp_path / "ref", tmp_path / "corpus"
    ref.mkdir()
    corpus.mkdir()
    for i in range(n_ref):
        (ref / f"ref{i:02d}.py").write_text(_function(1000 + i))
    for i in range(n_real):
        (corpus / f"real{i:02d}.py").write_text(_function(i))
    for i in range(n_junk):
        (corpus / f"junk{i:02d}.py").write_text(_garbage(i))
    return ref, corpus


def _settings(corpus, ref, threshold=None, seed=0):
    return PrepareSettings.from_flags(
        str(corpus), val_fraction=0, dedup="none", seed=seed, quality=QualitySettings(str(ref), threshold)
    )


def test_the_classifier_keeps_real_functions_and_removes_garbage(tmp_path):
    ref, corpus = _folders(tmp_path)
    # The real functions of the corpus are on both sides of what it learns (reference-like, yet in the corpus):
    # they score about 0.5-0.75, the garbage about 0.1.
    m = prepare(_settings(corpus, ref, threshold=0.3), tmp_path / "out", workers=1)
    rows = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    removed = {r["document"] for r in rows}
    assert all(r["stage"] == "quality" and 0 <= r["score"] < 0.3 for r in rows)
    assert sum(name.startswith("junk") for name in removed) >= 18  # of 20
    assert sum(name.startswith("real") for name in removed) <= 2  # of 20
    scores = m["report"]["quality"]
    assert scores["count"] == 40 and sum(scores["histogram"]) == 40 and len(scores["deciles"]) == 11
    assert m["report"]["stages"]["quality"]["docs"] == len(rows) == 40 - m["splits"]["train"]["docs"]
    state = m["settings"]["quality"].pop("state")
    assert m["settings"]["quality"] == {"reference": str(ref), "threshold": 0.3, "labels": None} and len(state) == 64
    (ref / "more.py").write_text(_function(5000))  # REF changed: the folder is not already prepared
    with pytest.raises(GptforgeError, match="with other settings \\(--quality REF's files changed since"):
        prepare(_settings(corpus, ref, threshold=0.3), tmp_path / "out", workers=1)
    again = prepare(_settings(corpus, ref, threshold=0.3), tmp_path / "out", workers=1, force=True)
    assert again["settings"]["quality"]["state"] not in (None, state)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Quality scores" in report and "| quality |" in report
    q = again["report"]["quality"]  # the run report.md is from
    for i, (n, shown) in enumerate(zip(q["histogram"], q["samples"], strict=True)):
        sides = {side: [d["score"] for d in shown[side]] for side in ("kept", "removed")}
        assert all(i / 10 <= s < (i + 1) / 10 for s in sides["kept"] + sides["removed"]), (i, sides)
        assert all(s >= 0.3 for s in sides["kept"]) and all(s < 0.3 for s in sides["removed"])
        assert len(sides["kept"]) + len(sides["removed"]) == min(n, 3)  # a tenth is on one side of 0.3
        row = f"| {i / 10:.1f}-{(i + 1) / 10:.1f} | {n:,} | "
        assert row in report and all(f"`{d['document']}` ({d['score']:.3f})" in report for d in shown["removed"])


def test_the_pareto_rule_keeps_by_score_seeded_per_document():
    rule = Classifier(None, None, QualitySettings("ref"), seed=0)
    names = [f"doc{i}.py" for i in range(2000)]
    assert all(rule.keeps(1.0, n) for n in names)  # a draw is never negative: a perfect score always stays
    assert sum(rule.keeps(0.0, n) for n in names) < 20  # (1 + 1) ** -9: about 4 of 2000
    kept = sum(rule.keeps(0.9, n) for n in names) / len(names)
    assert abs(kept - 1.1**-9) < 0.04  # GPT-3's alpha 9: about 0.42
    again = [rule.keeps(0.9, n) for n in names]
    other_seed = [Classifier(None, None, QualitySettings("ref"), seed=1).keeps(0.9, n) for n in names]
    assert again == [rule.keeps(0.9, n) for n in names] and again != other_seed
    threshold = Classifier(None, None, QualitySettings("ref", 0.5), seed=0)
    assert threshold.keeps(0.5, "a") and not threshold.keeps(0.4999, "a")


def _fitted(monkeypatch):
    """The scikit-learn models that `Linear.of` is given, in a list filled as they are fitted."""
    fitted, of = [], quality.Linear.of.__func__
    monkeypatch.setattr(
        quality.Linear, "of", classmethod(lambda cls, m, logistic: fitted.append(m) or of(cls, m, logistic))
    )
    return fitted


def test_scores_are_the_fitted_models_probabilities_intercept_included(monkeypatch):
    fitted = _fitted(monkeypatch)
    reference = [_function(1000 + i) for i in range(8)]
    corpus = [_function(i) for i in range(4)] + [_garbage(i) for i in range(4)]
    classifier = quality.train(reference, corpus, QualitySettings("ref"), seed=0)
    scores = classifier.scores(corpus)
    (model,) = fitted
    features = classifier.vectorizer.transform(corpus)
    np.testing.assert_allclose(scores, model.predict_proba(features)[:, 1], rtol=1e-6)
    by_hand = 1 / (1 + np.exp(-(features @ model.coef_.ravel() + model.intercept_[0])))
    np.testing.assert_allclose(scores, by_hand, rtol=1e-6)
    # Recorded: the intercept (about -0.09) moves each of them by 0.004-0.02.
    recorded = [0.653452, 0.601396, 0.513782, 0.646130, 0.054522, 0.047056, 0.049579, 0.042285]
    assert scores == pytest.approx(recorded, abs=1e-5)


def test_a_regressors_scores_are_its_clipped_predictions_intercept_included(monkeypatch):
    fitted = _fitted(monkeypatch)
    texts = [_function(2000 + i) for i in range(6)] + [_garbage(500 + i) for i in range(6)]
    classifier = quality.train_regressor(texts, [0.9] * 6 + [0.2] * 6, QualitySettings(labels="l"), seed=0)
    scores = classifier.scores(texts)
    (model,) = fitted
    expected = np.clip(model.predict(classifier.vectorizer.transform(texts)), 0, 1)
    np.testing.assert_allclose(scores, expected, rtol=1e-6)
    recorded = [0.454412, 0.45461, 0.448161, 0.446003, 0.451982, 0.453164]
    recorded += [0.040127, 0.03891, 0.036536, 0.034823, 0.035921, 0.037016]
    assert scores == pytest.approx(recorded, abs=1e-5)


def test_a_threshold_keeps_the_documents_scoring_at_least_it(tmp_path):
    ref, corpus = _folders(tmp_path, n_ref=8, n_real=4, n_junk=4)
    m = prepare(_settings(corpus, ref, threshold=0.535), tmp_path / "out", workers=1)
    rows = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    removed = {r["document"]: r["score"] for r in rows}
    junk = {"junk00.py": 0.0561, "junk01.py": 0.0616, "junk02.py": 0.0471, "junk03.py": 0.0529}
    assert removed == {**junk, "real01.py": 0.5232}
    kept = {d["document"]: d["score"] for tenth in m["report"]["quality"]["samples"] for d in tenth["kept"]}
    # Scored without the intercept (about -0.09), real01 would be 0.543 and kept.
    assert kept == {"real00.py": 0.6311, "real02.py": 0.5474, "real03.py": 0.6194}


def test_quality_keeps_the_same_documents_whatever_the_worker_count(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 3)  # many small batches, finished by the workers in any order
    monkeypatch.setattr(pipeline, "cpu_count", lambda: 3)
    ref, corpus = _folders(tmp_path)
    one = prepare(_settings(corpus, ref), tmp_path / "one", workers=1)
    three = prepare(_settings(corpus, ref), tmp_path / "three", workers=3)
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in three["shards"]]
    assert one["report"] == three["report"] and one["report"]["stages"]["quality"]["docs"] > 0
    assert (tmp_path / "one" / "removed.jsonl").read_bytes() == (tmp_path / "three" / "removed.jsonl").read_bytes()


@pytest.mark.parametrize(
    ("quality_flags", "match"),
    [
        (QualitySettings("missing"), "--quality: .*missing"),
        (QualitySettings("empty"), "--quality: .*empty"),
        (QualitySettings("ref", 1.5), r"--quality-threshold must be in \[0, 1\], got 1.5"),
        (QualitySettings(None, 0.5), "--quality-threshold 0.5: needs --quality"),
    ],
)
def test_a_bad_reference_or_threshold_is_one_line_naming_the_flag(tmp_path, monkeypatch, quality_flags, match):
    ref, corpus = _folders(tmp_path, n_ref=2, n_real=2, n_junk=2)
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GptforgeError, match=match):
        prepare(PrepareSettings.from_flags(str(corpus), val_fraction=0, quality=quality_flags), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_datatrove_tasks_keep_the_documents_the_local_engine_keeps(tmp_path):
    """The classifier, trained once, travels to each task; the Pareto draws are seeded per document."""
    ref, corpus = _folders(tmp_path)
    local = prepare(_settings(corpus, ref), tmp_path / "local", workers=1)
    tasks = prepare(_settings(corpus, ref), tmp_path / "dt", workers=1, engine=EngineSettings("datatrove", 2))
    assert tasks["report"] == local["report"] and 0 < local["report"]["stages"]["quality"]["docs"] < 40
    for name in [s["file"] for s in local["shards"]] + ["removed.jsonl", "report.md"]:
        assert (tmp_path / "dt" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name


def test_quality_is_refused_with_chat(tmp_path, capsys):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "a.py").write_text(_function(1))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["prepare", str(chat), "--out", str(tmp_path / "c"), "--chat", "--quality", str(ref)]) != 0
    assert "--quality: does not apply to conversations" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


def test_a_missing_scikit_learn_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.linear_model", None)  # `import` now raises ImportError
    with pytest.raises(GptforgeError, match=r"--quality needs its extra: pip install 'gptforge\[quality\]'"):
        quality.train(["def f(): pass"], ["x"], QualitySettings("ref"), seed=0)


def _labels(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_quality_labels_train_a_regressor_that_keeps_what_was_scored_high(tmp_path):
    _, corpus = _folders(tmp_path, n_ref=0)
    rows = [{"text": _function(2000 + i), "score": 1} for i in range(30)]
    rows += [{"text": _garbage(500 + i), "score": 0.0} for i in range(30)]
    labels = _labels(tmp_path / "labels.jsonl", rows)
    settings = PrepareSettings.from_flags(
        str(corpus), val_fraction=0, dedup="none", quality=QualitySettings(threshold=0.5, labels=str(labels))
    )
    m = prepare(settings, tmp_path / "out", workers=1)
    removed = [json.loads(line)["document"] for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    assert sum(name.startswith("junk") for name in removed) >= 18 and not any(n.startswith("real") for n in removed)
    assert m["settings"]["quality"]["labels"] == str(labels) and m["report"]["quality"]["count"] == 40
    assert f"Labels: `{labels}`" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"text": "x"}], r"labels.jsonl:1: expected \{\"text\": string, \"score\": number\}"),
        ([{"text": "x", "score": 0.5}, {"text": "y", "score": 2}], r"labels.jsonl:2: score 2 is outside \[0, 1\]"),
        ([["x", 1]], "labels.jsonl:1: expected"),
        ([], "no labelled documents"),
        ([{"text": "x \ud800", "score": 0.5}], r"labels.jsonl:1: text holds a lone surrogate \\ud800"),
    ],
)
def test_bad_quality_labels_are_one_line_naming_the_row(tmp_path, rows, match):
    _, corpus = _folders(tmp_path, n_ref=0, n_real=2, n_junk=2)
    labels = _labels(tmp_path / "labels.jsonl", rows)
    with pytest.raises(GptforgeError, match="--quality-labels .*" + match):
        prepare(PrepareSettings.from_flags(str(corpus), quality=QualitySettings(labels=str(labels))), tmp_path / "o")
    assert not (tmp_path / "o").exists()
    with pytest.raises(GptforgeError, match="--quality ref and --quality-labels .*: pass one of them"):
        PrepareSettings.from_flags(str(corpus), quality=QualitySettings("ref", labels=str(labels)))


def test_quality_labels_learn_from_a_seeded_sample_of_bounded_size_and_every_row_is_checked(tmp_path, monkeypatch):
    """Every row was learned from: 40,000 rows of 3,000 characters took 95 s and 4.2 GB, FineWeb-Edu's 450,000 more."""
    monkeypatch.setattr(quality, "LABELLED_DOCS", 5)
    labels = _labels(tmp_path / "labels.jsonl", [{"text": _function(i), "score": i / 50} for i in range(50)])
    texts, scores = quality.labelled(str(labels), seed=0)
    assert len(texts) == len(scores) == 5 and (texts, scores) == quality.labelled(str(labels), seed=0)
    assert [_function(round(s * 50)) for s in scores] == texts  # rows stay whole: each text with its own score
    assert quality.labelled(str(labels), seed=1) != (texts, scores)
    with labels.open("a") as f:
        f.write(json.dumps({"text": "late", "score": 7}) + "\n")
    with pytest.raises(GptforgeError, match="labels.jsonl:51: score 7 is outside"):
        quality.labelled(str(labels), seed=0)


def test_a_classifier_that_leaves_nothing_is_named_even_after_a_filter_removed_a_document(tmp_path):
    """The filters' message ("--clean code removed every document") named a filter that had removed 1 of 41."""
    ref, corpus = _folders(tmp_path, n_real=40, n_junk=0)
    (corpus / "long.py").write_text("x = 1  # " + "y" * 5000 + "\n")  # one line past code.max_line_length
    settings = PrepareSettings.from_flags(
        str(corpus), val_fraction=0, dedup="none", clean="code", quality=QualitySettings(str(ref), 0.999)
    )
    with pytest.raises(GptforgeError, match=r"--quality removed 40 of 41 documents and nothing else is left"):
        prepare(settings, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_classifier_that_leaves_only_the_held_out_document_is_named_with_the_scores_spread(tmp_path):
    """The first document always validates: when the classifier took every other one, the message blamed
    --val-fraction ("all held out for validation"); and without the report, no score to pick a threshold by."""
    ref, corpus = _folders(tmp_path, n_real=0, n_junk=12)
    (corpus / "a_first.py").write_text(_function(7))  # the first document: held out, and scored well
    settings = PrepareSettings.from_flags(str(corpus), dedup="none", quality=QualitySettings(str(ref), 0.5))
    with pytest.raises(GptforgeError) as e:
        prepare(settings, tmp_path / "out", workers=1)
    assert "--quality removed 12 of 13 documents and nothing else is left to train on" in str(e.value)
    assert "to train on; the 1 kept is held out for validation; scores ranged 0." in str(e.value)
    assert str(e.value).endswith(": lower --quality-threshold or pick another REF")
    assert not (tmp_path / "out").exists()


def test_filters_that_removed_most_but_not_all_are_not_said_to_have_removed_every_document(tmp_path):
    """The classifier took the documents the filters left: the message said the filters removed every one."""
    ref, corpus = _folders(tmp_path, n_real=2, n_junk=0)
    for i in range(3):
        (corpus / f"long{i}.py").write_text("x = 1  # " + "y" * 5000 + "\n")  # past code.max_line_length
    settings = PrepareSettings.from_flags(
        str(corpus), val_fraction=0, dedup="none", clean="code", quality=QualitySettings(str(ref), 1.0)
    )
    with pytest.raises(GptforgeError, match=r"--clean code removed 3 of 5 documents and --quality 2 \(filter"):
        prepare(settings, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_changed_reference_or_labels_file_is_said_so_not_as_two_digests(tmp_path):
    """The refusal read "state was '9b87…', now '21b9…'": true, but it did not say what had changed."""
    _, corpus = _folders(tmp_path, n_ref=0, n_real=2, n_junk=0)
    for q, said in (
        (QualitySettings("ref"), "--quality REF's files changed"),
        (QualitySettings(labels="l"), "l changed"),
    ):
        base = PrepareSettings.from_flags(str(corpus), quality=q)
        old, new, other = (
            dataclasses.replace(base, quality=dataclasses.replace(q, state=s, threshold=t))
            for s, t in (("a" * 64, None), ("b" * 64, None), ("a" * 64, 0.5))
        )
        message = new.difference(old.to_json())
        assert said in message and "aaaa" not in message
        assert "threshold was the default, now 0.5" in other.difference(old.to_json())


def test_a_folder_of_other_settings_is_refused_before_the_classifier_reads_the_corpus(tmp_path, monkeypatch):
    """The classifier's sample is a pass over the whole corpus: it ran, then --out was refused."""
    ref, corpus = _folders(tmp_path, n_real=4, n_junk=0)
    (tmp_path / "out").mkdir()
    saved = {"settings": _settings(corpus, ref, threshold=0).to_json(), "shards": []}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(saved))  # what an earlier prepare left
    monkeypatch.setattr(quality, "sample", lambda *a: pytest.fail("the corpus was sampled before the refusal"))
    with pytest.raises(GptforgeError, match="other settings .*threshold was 0, now 0.5"):
        prepare(_settings(corpus, ref, threshold=0.5), tmp_path / "out", workers=1)


def test_labels_that_leave_nothing_are_not_told_to_pick_another_ref(tmp_path):
    _, corpus = _folders(tmp_path, n_ref=0, n_real=3, n_junk=0)
    labels = _labels(tmp_path / "labels.jsonl", [{"text": _function(i), "score": 0} for i in range(5)])
    settings = PrepareSettings.from_flags(str(corpus), val_fraction=0, quality=QualitySettings(None, 0.5, str(labels)))
    with pytest.raises(GptforgeError, match=r"median 0\.000: lower --quality-threshold or give other labels$"):
        prepare(settings, tmp_path / "out", workers=1)


def test_a_reference_whose_files_were_all_skipped_says_why(tmp_path):
    """A folder of latin-1 files read as "no reference documents with text", though each file had text."""
    _, corpus = _folders(tmp_path, n_ref=0, n_real=2, n_junk=0)
    (tmp_path / "ref" / "latin.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (tmp_path / "ref" / "blank.py").write_text("\n")
    with pytest.raises(GptforgeError, match=r"no reference documents with text \(skipped: 1 empty, 1 undecodable\)$"):
        prepare(_settings(corpus, tmp_path / "ref"), tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_scores_fall_in_their_tenth_and_a_perfect_one_in_the_last():
    from gptforge.data.report import Report

    report = Report()
    for name, score, kept in (("a", 0.0, False), ("b", 0.099, False), ("c", 0.1, True), ("d", 0.95, True)):
        report.scored(name, score, kept, 1)
    report.scored("e", 1.0, True, 1)
    q = report.quality()
    assert q["histogram"] == [2, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    assert [d["document"] for d in q["samples"][9]["kept"]] == ["d", "e"] and q["samples"][0]["removed"][1][
        "score"
    ] == 0.099


def test_the_classifier_line_counts_its_documents_in_words(tmp_path, capsys):
    ref, corpus = _folders(tmp_path, n_ref=1, n_real=3, n_junk=0)
    prepare(_settings(corpus, ref, threshold=0.0), tmp_path / "out", workers=1)
    assert "quality classifier: 1 reference document against 3 of the corpus" in capsys.readouterr().out
