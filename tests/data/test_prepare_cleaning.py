"""prepare with de-duplication and quality filters: which documents stay, in which split, whatever the workers."""

import json
import random
import shutil

import pytest

import gptforge.data.pipeline as pipeline
from gptforge.data.loader import TokenLoader
from gptforge.data.prepare import is_validation, prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.report import summarize
from gptforge.data.shards import read_manifest
from gptforge.errors import GptforgeError

WORDS = [f"w{i}" for i in range(400)]


def _text(seed: int, lines: int = 40) -> str:
    """A distinct document: lines of random words (two of them share almost no 5-word shingle)."""
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choices(WORDS, k=8)) for _ in range(lines)) + "\n"


def _near_copy(text: str) -> str:
    """The same document with one line of 40 changed (Jaccard about 0.9)."""
    lines = text.splitlines()
    lines[7] = "a changed line of entirely new words here"
    return "\n".join(lines) + "\n"


def _corpus(root, n=12):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i:02d}.txt").write_text(_text(i))
    (root / "zz_exact.txt").write_text(_text(3))  # copies come later in source order: the earlier file is kept
    (root / "zz_near.txt").write_text(_near_copy(_text(5)))
    return root


def _shards(manifest):
    return [(s["file"], s["sha256"], s["docs"]) for s in manifest["shards"]]


def test_planted_exact_and_near_copies_are_removed_keeping_the_first(tmp_path):
    src = _corpus(tmp_path / "src")
    m = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), tmp_path / "out", workers=1)
    stages = m["report"]["stages"]
    assert stages["read"]["docs"] == 14 and stages["kept"]["docs"] == 12 == m["splits"]["train"]["docs"]
    assert stages["exact duplicates"]["docs"] == 1 and stages["near duplicates"]["docs"] == 1
    pairs = {p["removed"]: (p["kept"], p["kind"]) for p in m["report"]["duplicate_pairs"]}
    assert pairs == {"zz_exact.txt": ("doc03.txt", "exact"), "zz_near.txt": ("doc05.txt", "near")}
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| `zz_near.txt` | `doc05.txt` | near |" in report and "| near duplicates | 1 |" in report
    assert m["settings"]["dedup"]["mode"] == "near"
    raw = prepare(PrepareSettings.from_flags(str(src), val_fraction=0, dedup="none"), tmp_path / "raw", workers=1)
    assert raw["splits"]["train"]["docs"] == 14 and raw["report"]["stages"]["kept"]["docs"] == 14
    exact = prepare(PrepareSettings.from_flags(str(src), val_fraction=0, dedup="exact"), tmp_path / "exact", workers=1)
    assert exact["splits"]["train"]["docs"] == 13
    said = summarize(m, tmp_path / "out").splitlines()
    assert said[2].startswith("removed: exact duplicates 1 (") and ", near duplicates 1 (" in said[2]
    assert said[2].endswith("of 14 documents met (see report.md)")
    assert summarize(raw, tmp_path / "raw").splitlines()[2] == "removed: nothing of 14 documents met (see report.md)"


def _leaky_names(val_fraction=0.5):
    """An original whose name trains and a later copy whose name is drawn into validation."""
    train = next(f"a{i:03d}.txt" for i in range(1, 999) if not is_validation(f"a{i:03d}.txt", 1, val_fraction))
    val = next(f"b{i:03d}.txt" for i in range(999) if is_validation(f"b{i:03d}.txt", 1, val_fraction))
    return train, val


def test_a_near_copy_is_never_in_the_other_split(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    original, copy = _leaky_names()
    (src / "a000.txt").write_text(_text(100))  # the first document, always validation
    (src / original).write_text(_text(101))
    (src / copy).write_text(_near_copy(_text(101)))
    raw = prepare(PrepareSettings.from_flags(str(src), val_fraction=0.5, dedup="none"), tmp_path / "raw", workers=1)
    assert raw["splits"]["val"]["docs"] == 2  # without dedup the copy validates on what trained
    m = prepare(PrepareSettings.from_flags(str(src), val_fraction=0.5), tmp_path / "out", workers=1)
    assert m["splits"] == {**m["splits"], "val": {**m["splits"]["val"], "docs": 1}}
    assert m["splits"]["train"]["docs"] == 1
    (pair,) = m["report"]["duplicate_pairs"]
    assert pair["removed"] == copy and pair["kept"] == original


# Held out at --val-fraction 0.1 among doc000.py..doc199.py, computed once with zlib.crc32 outside gptforge: another
# hash key would move documents of existing folders between splits.
HELD_OUT = {
    0: [7, 12, 19, 26, 33, 42, 60, 78, 81, 100, 119, 135, 151, 158, 164, 172, 177, 188],
    7: [20, 24, 34, 35, 52, 63, 70, 108, 118, 139, 142, 150, 173, 180, 187, 191, 192, 199],
}


def test_the_validation_split_is_pinned_to_the_names_hash():
    names = [f"doc{i:03d}.py" for i in range(200)]
    for seed, expected in HELD_OUT.items():
        assert [i for i, n in enumerate(names) if is_validation(n, 1, 0.1, seed)] == expected
    assert is_validation(names[1], 0, 0.1) and not is_validation(names[7], 7, 0)  # the first always; 0: none


_encode = pipeline.encode


def slow_first_batch(jobs):
    """pipeline.encode, slow on the first batch: the other workers finish later batches before it."""
    import time

    if jobs[0].index == 0:
        time.sleep(1)
    return _encode(jobs)


def test_the_same_documents_are_kept_whatever_the_worker_count(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 2)  # many small batches, finished by the workers in any order
    monkeypatch.setattr(pipeline, "cpu_count", lambda: 3)
    src = _corpus(tmp_path / "src", n=20)
    one = prepare(
        PrepareSettings.from_flags(str(src), val_fraction=0.2, shard_tokens=3000), tmp_path / "one", workers=1
    )
    monkeypatch.setattr(pipeline, "encode", slow_first_batch)  # the workers import it from this module
    three = prepare(
        PrepareSettings.from_flags(str(src), val_fraction=0.2, shard_tokens=3000), tmp_path / "three", workers=3
    )
    assert _shards(one) == _shards(three) and one["report"] == three["report"]
    assert (tmp_path / "one" / "removed.jsonl").read_bytes() == (tmp_path / "three" / "removed.jsonl").read_bytes()


def test_resume_after_a_crash_with_dedup_gives_the_uninterrupted_shards(tmp_path, monkeypatch):
    import gptforge.data.prepare as prep

    src = _corpus(tmp_path / "src", n=30)
    (src / "zz_late_copy.txt").write_text(_text(2))  # its original sits in a shard written before the crash
    clean = prepare(
        PrepareSettings.from_flags(str(src), val_fraction=0.2, shard_tokens=1500), tmp_path / "clean", workers=1
    )
    real = prep.documents

    def crashing(source, field, **kw):
        for i, doc in enumerate(real(source, field, **kw)):
            if i == 24:
                raise RuntimeError("simulated crash")
            yield doc

    monkeypatch.setattr(prep, "documents", crashing)
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0.2, shard_tokens=1500), tmp_path / "out", workers=1)
    assert json.loads((tmp_path / "out" / "progress.json").read_text())["shards"]
    monkeypatch.setattr(prep, "documents", real)
    resumed = prepare(
        PrepareSettings.from_flags(str(src), val_fraction=0.2, shard_tokens=1500), tmp_path / "out", workers=1
    )
    assert _shards(resumed) == _shards(clean) and resumed["report"] == clean["report"]
    assert (tmp_path / "out" / "removed.jsonl").read_bytes() == (tmp_path / "clean" / "removed.jsonl").read_bytes()
    assert resumed["report"]["stages"]["exact duplicates"]["docs"] == 2


def test_every_removed_document_is_a_row_of_removed_jsonl_with_its_stage(tmp_path):
    src = _corpus(tmp_path / "src", n=6)
    (src / "generated.py").write_text("a=1;" * 1000)
    (src / "blob.py").write_bytes(b"\x00\x01binary\x00" * 10)
    (src / "empty.py").write_text("")
    licence = "".join(
        f"# Licensed under the terms of the licence that comes with this file, line {i}\n" for i in range(16)
    )
    for name in ("lic_a", "lic_b"):  # distinct behind a shared licence: both kept
        (src / f"{name}.py").write_text(f"{licence}def {name}(x):\n    return {name}(x - 1)\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"ctx": _text(2).splitlines()[0] + " " + _text(2).splitlines()[1]}) + "\n")
    flags = dict(val_fraction=0, clean="code", decontaminate=[str(evals)], clean_set=["code.min_alpha_fraction=0"])
    m = prepare(PrepareSettings.from_flags(str(src), **flags), tmp_path / "out", workers=1)
    rows = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    assert [(r["document"], r["stage"]) for r in rows] == [
        ("doc02.txt", "decontaminated"),
        ("generated.py", "filtered"),
        ("zz_exact.txt", "exact duplicates"),
        ("zz_near.txt", "near duplicates"),
        ("blob.py", "binary skipped"),
        ("empty.py", "empty skipped"),
    ]
    assert rows[1]["filter"] == m["report"]["filtered_samples"][0]["filter"] and rows[1]["reason"]
    assert (rows[2]["kept"], rows[2]["jaccard"]) == ("doc03.txt", 1.0)
    assert rows[3]["kept"] == "doc05.txt" and 0.7 <= rows[3]["jaccard"] < 1
    assert "`removed.jsonl` (6 rows)" in (tmp_path / "out" / "report.md").read_text()


def test_clean_code_removes_a_minified_file_and_names_its_filter(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"mod{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(20)))
    (src / "generated.py").write_text("a=1;" * 1000)  # one 4,000-character line
    m = prepare(PrepareSettings.from_flags(str(src), val_fraction=0, clean="code"), tmp_path / "out", workers=1)
    assert m["splits"]["train"]["docs"] == 3 and m["report"]["stages"]["filtered"]["docs"] == 1
    (sample,) = m["report"]["filtered_samples"]
    assert sample["removed"] == "generated.py" and sample["filter"].startswith("code.")
    assert sample["filter"] in m["report"]["filters"]
    kept = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), tmp_path / "raw", workers=1)
    assert kept["splits"]["train"]["docs"] == 4  # off unless asked


def test_a_filter_that_removes_every_document_is_one_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("a=1;" * 1000)
    with pytest.raises(GptforgeError, match=r"--clean code removed every document \(filter code\.\S+ removed 1 of 1"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, clean="code"), tmp_path / "out", workers=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dedup": "fuzzy"}, "--dedup 'fuzzy': expected one of none, exact, near"),
        ({"clean": "prose"}, "--clean 'prose': expected one of"),
        ({"clean_set": ["code.nope=1"]}, "unknown key code.nope"),
        (  # settings of filters that do not run would be ignored
            {"clean_set": ["code.max_line_length=2000"]},
            r"^--clean-set code.max_line_length=2000: changes code filters, which --clean none does not run; pass "
            "--clean code$",
        ),
        (
            {"clean": "code", "clean_set": ["web.min_words=30"]},
            "web.min_words=30: changes web filters, which --clean code",
        ),
        ({"clean": "web", "clean_set": ["skip=web.c4_sentences,code.xml"]}, "changes code filters, which --clean web"),
        (  # the classifier is not a filter section: say which flag sets its threshold
            {"clean": "code", "clean_set": ["quality.threshold=0.5"]},
            r"quality.threshold=0.5: the quality classifier's threshold is --quality-threshold T",
        ),
    ],
)
def test_bad_cleaning_flags_are_one_line_before_any_work(tmp_path, kwargs, message):
    src = _corpus(tmp_path / "src", n=2)
    with pytest.raises(GptforgeError, match=message):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, **kwargs), tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_bad_dedup_numbers_are_one_line(tmp_path):
    from gptforge.data.clean.dedup import DedupSettings

    src = _corpus(tmp_path / "src", n=2)
    for settings, message in [
        (DedupSettings(threshold=0), "--dedup-threshold must be in"),
        (DedupSettings(bands=5), "--dedup-bands 5: expected a positive divisor of --dedup-hashes 128"),
        (DedupSettings(shingle=0), r"--dedup-shingle must be in \[1, 64\], got 0"),
        (DedupSettings(shingle=65), r"--dedup-shingle must be in \[1, 64\], got 65"),
        (DedupSettings(hashes=1_000_000, bands=1), r"--dedup-hashes must be in \[1, 1024\], got 1000000"),
        (DedupSettings(hashes=2048, bands=2048), r"--dedup-hashes must be in \[1, 1024\], got 2048"),
        (DedupSettings(mode="exact", hashes=64), "--dedup-hashes 64: tunes near de-duplication, which --dedup exact"),
        (DedupSettings(mode="none", threshold=0.5), "--dedup-threshold 0.5: tunes near de-duplication"),
    ]:
        with pytest.raises(GptforgeError, match=message):
            prepare(PrepareSettings.from_flags(str(src), val_fraction=0, dedup=settings), tmp_path / "out", workers=1)


def test_a_folder_prepared_before_dedup_still_loads_and_says_its_split_may_leak(tmp_path, capsys):
    src = _corpus(tmp_path / "src", n=20)
    out = tmp_path / "out"
    prepare(PrepareSettings.from_flags(str(src), val_fraction=0.3, shard_tokens=500, dedup="none"), out, workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("dedup", "clean", "ext"):  # as written before these settings existed
        manifest["settings"].pop(key, None)
    (out / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert (
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0.3, shard_tokens=500), out, workers=1)["settings"]
        == manifest["settings"]
    )
    assert "already prepared with these settings" in capsys.readouterr().out
    TokenLoader(out, "train", batch_size=1, seq_len=8)
    assert capsys.readouterr().out == ""
    TokenLoader(out, "val", batch_size=1, seq_len=8)
    assert "may hold near-copies of training documents" in capsys.readouterr().out
    with pytest.raises(GptforgeError, match=r"--clean/--clean-set was the default, now .code."):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0.3, shard_tokens=500, clean="code"), out, workers=1)
    assert read_manifest(out)["settings"] == manifest["settings"]


def test_code_in_any_language_is_read_with_its_language_and_binary_files_are_skipped(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "app.js").write_text("function add(a, b) { return a + b; }\n" * 3)
    (src / "main.c").write_text("int main(void) { return 0; }\n")
    (src / "srv.go").write_text("package main\nfunc main() {}\n")
    (src / "blob.py").write_bytes(b"\x00\x01binary\x00" * 100)  # a .py by name, binary by content
    (src / "data.json").write_text('{"a": 1}')  # data files are read only when --ext asks
    (src / "legacy.py").write_bytes("# -*- coding: latin-1 -*-\nname = 'café'\n".encode("latin-1"))  # not UTF-8
    (src / "empty.py").write_text("")
    (src / "rows.jsonl").write_text('{"text": null}\n{"text": "  "}\n')  # null: empty, as parquet and hf: read it
    m = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), tmp_path / "out", workers=1)
    languages = m["report"]["languages"]
    assert languages == {lang: {"read": 1, "kept": 1} for lang in ("C", "Go", "JavaScript")}
    assert m["report"]["stages"]["binary skipped"] == {"docs": 1, "bytes": 900}
    assert m["report"]["stages"]["undecodable skipped"] == {"docs": 1, "bytes": 40}
    assert m["report"]["stages"]["empty skipped"] == {"docs": 3, "bytes": 2}
    shares = {
        row.split("|")[1].strip(): float(row.split("|")[4].strip(" %"))
        for row in (tmp_path / "out" / "report.md").read_text().splitlines()
        if row.startswith("| ") and row.endswith("% |")
    }
    assert shares["binary skipped"] == round(100 * 900 / (m["report"]["stages"]["read"]["bytes"] + 942), 2)
    met = sum(v for stage, v in shares.items() if stage == "read" or "skipped" in stage)
    assert met == pytest.approx(100, abs=0.02)  # skipped files are part of the whole, not over 100% of it
    with pytest.raises(GptforgeError, match=r"legacy\.py: expected UTF-8 text"):  # named alone, it is the corpus
        prepare(PrepareSettings.from_flags(str(src / "legacy.py"), val_fraction=0), tmp_path / "alone", workers=1)
    only_go = prepare(PrepareSettings.from_flags(str(src), val_fraction=0, ext="go,json"), tmp_path / "go", workers=1)
    assert set(only_go["report"]["languages"]) == {"Go", "JSON"} and only_go["settings"]["ext"] == [".go", ".json"]


def test_a_trained_tokenizer_learns_only_from_the_documents_kept(corpus_dir, tmp_path):
    base, noisy = tmp_path / "base", tmp_path / "noisy"
    shutil.copytree(corpus_dir, base)
    shutil.copytree(corpus_dir, noisy)
    first = sorted(noisy.glob("*.py"))[1]
    for i in range(30):  # copies of one file and minified junk: what would skew the merges if it were counted
        shutil.copy(first, noisy / f"zz_copy_{i:02d}.py")
        (noisy / f"zz_minified_{i:02d}.py").write_text("x=[" + ",".join(f"q{i}w{j}" for j in range(600)) + "]\n")
    args = {"val_fraction": 0.1, "train_tokenizer": 300, "clean": "code"}
    prepare(PrepareSettings.from_flags(str(base), **args), tmp_path / "a", workers=1)
    m = prepare(PrepareSettings.from_flags(str(noisy), **args), tmp_path / "b", workers=1)
    assert m["report"]["stages"]["exact duplicates"]["docs"] == 30 and m["report"]["filters"]
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


@pytest.mark.parametrize("dedup", ["near", "exact"])
def test_a_copy_of_a_contaminated_document_never_names_it_as_the_one_kept(tmp_path, dedup):
    """Copies of a decontaminated document said `"kept": "<the contaminated one>"` in removed.jsonl and report.md."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):  # doc00 is held out (the first document always is): not checked for contamination
        (src / f"doc{i:02d}.txt").write_text(_text(i + 10))
    leak = _text(99, lines=2)  # 16 words of the evaluation file, in doc01 only
    (src / "doc01.txt").write_text(leak + _text(0))
    (src / "doc02.txt").write_text(leak + _text(0))  # an exact copy of the contaminated one: contaminated too
    (src / "doc03.txt").write_text(_near_copy(_text(0)))  # a near copy without the leak: kept, no one's copy
    (src / "doc04.txt").write_text(_near_copy(_text(0)).replace("a changed line", "another changed line"))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"ctx": leak}) + "\n")
    flags = dict(val_fraction=0, dedup=dedup, decontaminate=[str(evals)])
    prepare(PrepareSettings.from_flags(str(src), **flags), tmp_path / "out", workers=1)
    rows = [json.loads(line) for line in (tmp_path / "out" / "removed.jsonl").read_text().splitlines()]
    removed = {r["document"] for r in rows}
    assert {"doc01.txt", "doc02.txt"} <= removed and "doc03.txt" not in removed
    assert [r["stage"] for r in rows if r["document"] in ("doc01.txt", "doc02.txt")] == ["decontaminated"] * 2
    named = {r["kept"] for r in rows if "kept" in r}
    assert not named & removed, rows  # each removal names a document that was kept
    if dedup == "near":
        assert {r["document"]: r["kept"] for r in rows if "kept" in r} == {"doc04.txt": "doc03.txt"}


def test_a_classifier_that_keeps_almost_nothing_is_said_loudly_with_thresholds_that_would_keep_more():
    """`--quality REF` with the Pareto rule kept 7 of 717 documents (no validation split) and exited 0 unremarked."""
    from gptforge.data.report import STAGES, summarize

    stages = {s: {"docs": 0, "bytes": 0} for s in STAGES}
    stages["read"]["docs"], stages["quality"]["docs"], stages["kept"]["docs"] = 717, 710, 7
    deciles = [0.01, 0.02, 0.05, 0.08, 0.1, 0.12, 0.2, 0.3, 0.4, 0.6, 0.95]
    manifest = {
        "splits": {"train": {"docs": 7, "tokens": 900, "bytes": 3000}},
        "settings": {"val_fraction": 0},
        "shards": [{}],
        "report": {"stages": stages, "quality": {"count": 717, "deciles": deciles}},
    }
    text = summarize(manifest, "out")
    assert (
        "warning: the quality classifier kept 7 of the 717 documents it scored (1.0%): --quality-threshold 0.120 "
        "would keep about half of them, 0.020 about 90%"
    ) in text
    stages["quality"]["docs"], stages["kept"]["docs"] = 640, 77  # 10.7% kept: no warning
    assert "warning" not in summarize(manifest, "out")
