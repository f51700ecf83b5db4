"""Corpus readers: every source kind, stable names, and a clear error for each bad input."""

import gzip
import json
import os

import pytest

from gptforge.data.sources import documents, resolve
from gptforge.errors import GptforgeError


def test_text_jsonl_gzip_and_parquet_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("plain text")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("gzipped text")
    with gzip.open(tmp_path / "sub" / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"content": "line one"}) + "\n\n" + json.dumps({"content": "line two"}) + "\n")
    pq.write_table(pa.table({"content": ["row zero", "row one"]}), tmp_path / "sub" / "d.parquet")
    (tmp_path / "ignored.bin").write_bytes(b"\0\1")
    docs = list(documents(str(tmp_path), "content"))
    assert docs == [
        ("a.txt", "plain text"),
        ("b.txt.gz", "gzipped text"),
        ("sub/c.jsonl.gz:1", "line one"),
        ("sub/c.jsonl.gz:3", "line two"),
        ("sub/d.parquet:0", "row zero"),
        ("sub/d.parquet:1", "row one"),
    ]
    assert [n for n, _ in documents(str(tmp_path / "sub" / "*.parquet"), "content")] == [
        f"{tmp_path.as_posix()}/sub/d.parquet:0",
        f"{tmp_path.as_posix()}/sub/d.parquet:1",
    ]


def test_ext_decides_whether_a_folder_s_jsonl_is_read(tmp_path):
    from gptforge.data.languages import parse_extensions

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "a record"}) + "\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"no_text": 1}) + "\n")  # read, it would fail: --ext py skips it

    def names(ext):
        kw = {} if ext is None else {"extensions": parse_extensions(ext)}
        return [name for name, _ in documents(str(tmp_path), "text", **kw) if not name.startswith("c.jsonl")]

    assert names("py") == ["a.py"]
    with pytest.raises(GptforgeError, match="c.jsonl:1"):
        names(None)  # the default reads every JSONL file
    (tmp_path / "c.jsonl").unlink()
    assert names(None) == names("py,jsonl") == names("+go") == ["a.py", "b.jsonl:1"]


def test_hf_dataset_streams_from_a_local_folder(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "ds" / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"content": ["def a(): pass", "x = 1"]}).to_parquet(
        tmp_path / "ds" / "data" / "train-00000-of-00001.parquet"
    )
    docs = list(documents(f"hf:{tmp_path / 'ds'}", "content"))
    assert [t for _, t in docs] == ["def a(): pass", "x = 1"]
    with pytest.raises(GptforgeError, match="no field 'text'"):
        list(documents(f"hf:{tmp_path / 'ds'}", "text"))


def test_a_save_to_disk_folder_is_a_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"text": ["print(1)", "y = 2"]})
    rows.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": rows, "test": rows.select([0])}).save_to_disk(str(tmp_path / "dict"))
    for folder in ("one", "dict"):
        assert [t for _, t in documents(f"hf:{tmp_path / folder}", "text")] == ["print(1)", "y = 2"]
    datasets.DatasetDict({"test": rows}).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(GptforgeError, match=r"the saved dataset has no 'train' split \(it has \['test'\]\)"):
        list(documents(f"hf:{tmp_path / 'no-train'}", "text"))


def test_presets_name_the_public_datasets():
    assert resolve("fineweb-edu-10b", None) == ("hf:HuggingFaceFW/fineweb-edu:sample-10BT", "text")
    assert resolve("codeparrot", None) == ("hf:codeparrot/codeparrot-clean", "content")
    assert resolve("codeparrot", "text") == ("hf:codeparrot/codeparrot-clean", "text")
    assert resolve("corpus/", None) == ("corpus/", "text")


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("bad.txt", b"caf\xe9 is latin-1, not utf-8 \xc3", r"bad\.txt: expected UTF-8 text"),
        ("bad.jsonl.gz", b"this is not gzip", r"bad\.jsonl\.gz: corrupt or truncated gzip"),
        ("bad.jsonl", b'{"text": 3}\n', r"bad\.jsonl:1: field 'text' is int, expected a string"),
        ("bad.parquet", b"PAR1 nonsense", r"bad\.parquet: not a readable parquet file"),
        ("s.jsonl", b'{"text": "\\ud800 x"}\n', r"s\.jsonl:1: field 'text' holds a lone surrogate \\ud800"),
        ("deep.jsonl", b"[" * 200_000 + b"]" * 200_000, r"deep\.jsonl:1: JSON nested too deeply"),
        (
            "chat.jsonl",
            b'{"messages": []}\n',
            r"chat\.jsonl:1: expected .* field 'text', found an object without it .*; conversations\? use --chat",
        ),
    ],
)
def test_bad_files_are_named(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(GptforgeError, match=message):
        list(documents(str(tmp_path / name), "text"))


def test_missing_sources(tmp_path):
    with pytest.raises(GptforgeError, match="no such file or directory"):
        documents(str(tmp_path / "nope"), "text")
    with pytest.raises(GptforgeError, match="no files match"):
        documents(str(tmp_path / "*.jsonl"), "text")


def test_what_is_not_a_corpus_says_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "broken").symlink_to("nowhere")
    (tmp_path / "saved").mkdir()  # what datasets' save_to_disk writes
    for name in ("data-00000-of-00001.arrow", "dataset_info.json", "state.json"):
        (tmp_path / "saved" / name).write_text("{}")
    (tmp_path / "code").mkdir()
    for name in ("a.png", "b.png", "c.o"):  # kinds no language of languages.py names
        (tmp_path / "code" / name).write_text("int x;")
    (tmp_path / "empty").mkdir()
    expected = r"\(expected source or text files \(gptforge/data/languages.py, see --ext\), .jsonl or .parquet"
    cases = [
        ("fifo", r"fifo: not a regular file or folder \(a FIFO, socket or device is not a corpus\)"),
        ("broken", r"broken: a link to nowhere, which does not exist"),
        ("saved", rf"saved: a folder written by datasets' save_to_disk; read it as hf:{tmp_path}/saved"),
        ("code", rf"code: no file of a kind prepare reads {expected}; found 2 \.png, 1 \.o\)"),
        ("code/a.png", rf"a.png: no file of a kind prepare reads {expected}; found 1 \.png\)"),
        ("empty", rf"empty: no files in it {expected}\)"),
    ]
    for name, message in cases:
        with pytest.raises(GptforgeError, match=message):
            documents(str(tmp_path / name), "text")


def test_symlink_loops_and_aliases_are_read_once(tmp_path):
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("a")
    (tmp_path / "c" / "sub" / "b.txt").write_text("b")
    (tmp_path / "c" / "sub" / "loop").symlink_to("..")  # glob.glob('**') would follow this 40 levels deep
    (tmp_path / "c" / "z.txt").symlink_to("a.txt")
    (tmp_path / "c" / ".hidden.txt").write_text("h")
    folder = [t for _, t in documents(str(tmp_path / "c"), "text")]
    glob = list(documents(str(tmp_path / "c" / "**" / "*.txt"), "text"))
    assert sorted(folder) == ["a", "b", "h"]
    assert glob == [(f"{tmp_path.as_posix()}/c/a.txt", "a"), (f"{tmp_path.as_posix()}/c/sub/b.txt", "b")]
    assert [t for _, t in documents(str(tmp_path / "c" / ".*.txt"), "text")] == ["h"]


@pytest.mark.parametrize("values", [[1, 2], [["a"], ["b"]], [b"a", b"b"]])
def test_a_parquet_text_column_of_another_type_is_named(tmp_path, values):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": values}), tmp_path / "i.parquet")
    with pytest.raises(GptforgeError, match=r"i\.parquet: column 'text' is \w+.*, expected strings"):
        list(documents(str(tmp_path / "i.parquet"), "text"))


def test_a_glob_ending_in_double_star_reads_the_files_below(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c1" / "sub").mkdir(parents=True)
    (tmp_path / "c1" / "a.py").write_text("x = 1\n")
    (tmp_path / "c1" / "sub" / "b.py").write_text("y = 2\n")
    assert [name for name, _ in documents("c1/**")] == ["c1/a.py", "c1/sub/b.py"]
