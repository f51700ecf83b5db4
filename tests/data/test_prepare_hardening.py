"""prepare on hostile input: folders that are not ours, changed tokenizers, odd files, deep JSON; one line each."""

import json

import pytest

from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.errors import GptforgeError


def _code(tmp_path, n=1):
    src = tmp_path / "c"
    src.mkdir()
    for i in range(n):
        (src / f"a{i}.py").write_text(f"x = {i}\n" * 20)
    return src


def test_a_folder_with_a_foreign_progress_json_is_not_taken_for_ours(tmp_path):
    src, out = _code(tmp_path), tmp_path / "out"
    out.mkdir()
    mine = {"progress.json": '{"epoch": 3}', "report.md": "notes", "tokenizer.json": '{"mine": 1}'}
    for name, text in mine.items():
        (out / name).write_text(text)
    with pytest.raises(GptforgeError, match="exists and is not empty"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    assert {p.name: p.read_text() for p in out.iterdir()} == mine


def test_a_folder_this_command_made_is_removed_on_error(tmp_path):
    """(A folder that existed before is kept, marked failed: test_prepare.py's failed-midway test.)"""
    src = _code(tmp_path)
    with pytest.raises(GptforgeError, match="all held out"):
        prepare(PrepareSettings.from_flags(str(src / "a0.py"), val_fraction=0.5), tmp_path / "new", workers=1)
    assert not (tmp_path / "new").exists()


def test_a_changed_tokenizer_file_is_not_resumed(tmp_path):
    from gptforge.tokens.tokenizer import train_bpe

    src, out, tok = _code(tmp_path, 3), tmp_path / "out", tmp_path / "tok.json"
    train_bpe(["x = 1\n" * 9], 300, tok)
    settings = PrepareSettings.from_flags(str(src), tokenizer=str(tok), val_fraction=0, shard_tokens=20)
    manifest = prepare(settings, out, workers=1)
    (out / "manifest.json").unlink()  # as a kill -9 after the last shard leaves it
    (out / "progress.json").write_text(json.dumps({k: manifest[k] for k in ("settings", "shards")}))
    train_bpe(["y = 2\n" * 9], 280, tok)
    with pytest.raises(
        GptforgeError, match=r"unfinished prepare with other settings \(--tokenizer \(the file's sha256"
    ):
        prepare(settings, out, workers=1)


def test_other_settings_are_said_value_by_value_not_as_python_objects():
    near, web = PrepareSettings.from_flags("stdlib"), PrepareSettings.from_flags("stdlib", clean="web")
    assert PrepareSettings.from_flags("stdlib", dedup="exact").difference(near.to_json()) == (
        "--dedup mode was 'near', now 'exact'"
    )
    assert web.difference(near.to_json()) == "--clean/--clean-set was the default, now 'web'"
    tuned = ["web.min_words=3", "web.max_words=9", "web.min_stop_words=1", "web.max_dup_lines=0.5"]
    assert PrepareSettings.from_flags("stdlib", clean="web", clean_set=tuned).difference(web.to_json()) == (
        "--clean/--clean-set web.min_words was 50, now 3; web.max_words was 100000, now 9; "
        "web.min_stop_words was 2, now 1; and 1 more"
    )
    assert PrepareSettings.from_flags("stdlib", ext="md,py").difference(near.to_json()) == (
        "--ext was the default, now .md,.py"
    )
    newer = {**near.to_json(), "future": 1}  # written by a later version
    assert near.difference(newer) == "settings with keys this version does not write (future)"


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"source": ""}, "SOURCE '': empty"),
        ({"source": "hf:"}, "SOURCE 'hf:': names no dataset"),
        ({"tokenizer": ""}, "--tokenizer '': empty"),
        ({"decontaminate": [""]}, "--decontaminate '': empty"),
    ],
)
def test_empty_names_are_refused(flags, message):
    with pytest.raises(GptforgeError, match=message):
        PrepareSettings.from_flags(**{"source": "c", **flags})


def test_the_same_folder_written_another_way_is_the_same_source(tmp_path, monkeypatch):
    from gptforge.outputs import check_output_dir

    monkeypatch.chdir(tmp_path)
    _code(tmp_path).rename("c1")
    saved = PrepareSettings.from_flags("c1").to_json()
    for same in ("c1/", "./c1", str(tmp_path / "c1")):
        assert PrepareSettings.from_flags(same).matches(saved), same
    assert not PrepareSettings.from_flags("c2").matches(saved)
    with pytest.raises(GptforgeError, match="--out '': empty"):
        check_output_dir("", force=True)
    with pytest.raises(GptforgeError, match="--out '': empty"):
        prepare(PrepareSettings.from_flags("c1"), "", workers=1)


def test_the_summary_adds_up_and_does_not_say_wrote():
    from gptforge.data.report import STAGES, summarize

    stages = {s: {"docs": 0, "bytes": 0} for s in STAGES}
    stages.update(read={"docs": 2, "bytes": 20}, kept={"docs": 2, "bytes": 20})
    stages["empty skipped"] = {"docs": 4, "bytes": 0}
    split = {"docs": 2, "tokens": 9, "bytes": 20}
    lines = summarize({"splits": {"train": split}, "report": {"stages": stages}, "shards": [{}]}, "o").splitlines()
    assert lines[1] == "removed: empty skipped 4 (0.00 MB) of 6 documents met (see report.md)"
    assert lines[2] == "o: 1 shard(s) and manifest.json"
    odd = summarize({"splits": {"train": split}, "report": {"stages": stages}, "shards": [{}]}, "new\nline")
    assert odd.splitlines()[-1] == "new\\nline: 1 shard(s) and manifest.json"  # a newline in --out stays escaped
    empty = {"docs": 0, "tokens": 0, "bytes": 0}
    for fraction, val, said in ((0.1, empty, True), (0.1, split, False), (0.0, empty, False)):
        m = {"settings": {"val_fraction": fraction}, "splits": {"train": split, "val": val}, "shards": [{}]}
        assert ("val: none kept, the stages removed every held-out document" in summarize(m, "o")) == said


def test_odd_file_names_keep_report_md_tables_whole():
    """A `|`, a backtick or a newline in a name split its row (`a|b`c.py` read as three cells, `new⏎line.py` as two)."""
    import re

    from gptforge.data.report import Report, render

    report = Report()
    report.duplicate("exact", "new\nline.py", "a|b`c.py", 1.0, 10)
    report.filter_removed("``x|.py", "code.max_line_length", "a line of 2,000 characters", 5)
    report.filter_removed("gen.py", "code.autogenerated", "its first lines say 'x | generated\nby y'", 5)
    report.scored("tab\there.py", 0.5, False, 3)
    text = render(report.to_json(), {"source": "s", "quality": {"reference": "ref"}})
    for table in re.findall(r"(?:^\|.*\n)+(?:^.+\n)*", text, re.MULTILINE):  # a table and any lines its rows spilled
        widths = {len(re.findall(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert all(row.startswith("|") for row in table.splitlines()) and len(widths) == 1, table
    assert "``a\\|b`c.py``" in text and "`new\\nline.py`" in text and "``` ``x\\|.py ```" in text


def test_file_names_that_are_not_utf8_are_read_under_escaped_names(tmp_path):
    """On Linux a name is bytes: b'caf\\xe9.py' (Latin-1) reaches Python as 'caf\\udce9.py', which no UTF-8 file
    holds; removed.jsonl, report.md and manifest.json name it as backslashreplace shows it."""
    import os

    src, out = _code(tmp_path), tmp_path / "out"
    kept, copy = src / os.fsdecode(b"caf\xe9.py"), src / os.fsdecode(b"dup\xff.py")
    kept.write_text("def f(x):\n    return x + 1\n" * 20)
    copy.write_text(kept.read_text())
    (src / os.fsdecode(b"bin\xfe.py")).write_bytes(b"\x00\x01" * 100)
    manifest = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    assert manifest["splits"]["train"]["docs"] == 2
    texts = {name: (out / name).read_bytes().decode() for name in ("removed.jsonl", "report.md", "manifest.json")}
    removed = [json.loads(line) for line in texts["removed.jsonl"].splitlines()]
    assert {(r["document"], r["stage"], r.get("kept")) for r in removed} == {
        ("dup\\xff.py", "exact duplicates", "caf\\xe9.py"),
        ("bin\\xfe.py", "binary skipped", None),
    }
    assert "`dup\\xff.py` | `caf\\xe9.py`" in texts["report.md"]
    assert "\\ud" not in texts["manifest.json"]  # no lone surrogate written as a JSON escape either
