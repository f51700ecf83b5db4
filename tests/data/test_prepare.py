import json

import numpy as np
import pytest
from tests.helpers import lock_held_elsewhere

import gptforge.data.pipeline as pipeline
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.data.shards import read_manifest, read_shard
from gptforge.errors import GptforgeError
from gptforge.tokens.tokenizer import load_tokenizer


def test_shards_hold_every_document_eot_delimited(corpus_dir, data_dir):
    m = read_manifest(data_dir)
    tok = load_tokenizer("gpt2")
    assert m["tokenizer"] == {"name": "gpt2", "vocab_size": 50257, "eot": 50256}
    streams = {
        split: np.concatenate([read_shard(data_dir / s["file"]) for s in m["shards"] if s["split"] == split])
        for split in ("train", "val")
    }
    assert len(m["shards"]) > 2, "shard_tokens=2000 must split the training stream"
    assert all(s["tokens"] <= 2000 for s in m["shards"])
    files = sorted(corpus_dir.glob("*.py"))
    assert m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"] == len(files)
    assert m["splits"]["val"]["docs"] >= 1
    # Decoding the concatenated shards gives back the documents, each preceded by EOT.
    texts = {p.read_text() for p in files}
    for split, stream in streams.items():
        assert stream[0] == tok.eot
        docs = tok._enc.decode(stream.tolist()).split("<|endoftext|>")[1:]
        assert len(docs) == m["splits"][split]["docs"]
        assert set(docs) <= texts
        assert len(stream) == m["splits"][split]["tokens"]


def test_split_is_stable(corpus_dir, tmp_path, data_dir):
    again = prepare(
        PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, shard_tokens=2000), tmp_path, workers=1
    )
    assert again["shards"] == read_manifest(data_dir)["shards"]  # same files, same sha256


def test_empty_corpus(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blank.txt").write_text("   \n")
    with pytest.raises(GptforgeError, match="empty corpus"):
        prepare(PrepareSettings.from_flags(str(tmp_path / "src")), tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()  # found before anything was created


def test_missing_source(tmp_path):
    with pytest.raises(GptforgeError, match="no such file or directory"):
        prepare(PrepareSettings.from_flags(str(tmp_path / "nope")), tmp_path / "out", workers=1)


def test_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(GptforgeError, match=r"d\.jsonl:2: expected a JSON object with a string field 'text'"):
        prepare(PrepareSettings.from_flags(str(tmp_path / "d.jsonl")), tmp_path / "out", workers=1)


def test_trained_tokenizer_is_used_end_to_end(corpus_dir, tmp_path, data_dir):
    from gptforge.checkpoint import load_checkpoint
    from gptforge.config import load_config
    from gptforge.model.generate import generate
    from gptforge.train.trainer import train

    m = prepare(
        PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, train_tokenizer=320), tmp_path / "data", workers=1
    )
    assert m["tokenizer"]["name"] == "tokenizer.json" and m["tokenizer"]["vocab_size"] <= 320
    tok = load_tokenizer("tokenizer.json", tmp_path / "data")
    train_stream = read_shard(tmp_path / "data" / "train_000000.bin", tok.vocab_size)
    first_doc = tok.decode(train_stream[1:200].tolist()).split("<|endoftext|>")[0]
    assert first_doc in {p.read_text() for p in corpus_dir.glob("*.py")}  # decodes back to a source file

    cfg = load_config("tiny", [f"data.path={tmp_path / 'data'}", "train.max_steps=2"])
    result = train(cfg, tmp_path / "run")
    assert result.config.model.vocab_size == tok.vocab_size  # the data decides the vocabulary
    assert cfg.model.vocab_size == 50257  # and the caller's config is left as it was
    model, ckpt_tok, _, _ = load_checkpoint(result.checkpoint)
    assert (result.checkpoint / "tokenizer.json").is_file()  # the checkpoint carries its tokenizer
    assert ckpt_tok.encode("def add_all_1(values):") == tok.encode("def add_all_1(values):")
    new = generate(model, ckpt_tok.encode("def"), 5, temperature=0)[0]
    assert all(0 <= t < tok.vocab_size for t in new)

    # Data made with another tokenizer is refused on resume and by eval, naming both tokenizers.
    from gptforge.eval.suite import evaluate_checkpoint

    other = (
        r"made with tokenizer gpt2 \(50,257 tokens\), but checkpoint .* uses tokenizer\.json \(\d+ tokens\); prepare"
    )
    with pytest.raises(GptforgeError, match=other):
        train(load_config("tiny", [f"data.path={data_dir}"]), tmp_path / "run", resume="auto")
    with pytest.raises(GptforgeError, match=other):
        evaluate_checkpoint(str(result.checkpoint), data=str(data_dir))
    (tmp_path / "tiny.py").write_text("x = 1\n")
    with pytest.raises(GptforgeError, match=rf"^--text {tmp_path / 'tiny.py'}: \d+ tokens, too few for one batch"):
        evaluate_checkpoint(str(result.checkpoint), text=str(tmp_path / "tiny.py"))


def test_shards_end_at_document_boundaries(data_dir):
    m = read_manifest(data_dir)
    for shard in m["shards"]:
        tokens = read_shard(data_dir / shard["file"])
        assert tokens[0] == 50256  # every shard starts with a document's EOT
        assert int((tokens == 50256).sum()) == shard["docs"]


def test_second_prepare_is_a_no_op(corpus_dir, data_dir, capsys):
    again = prepare(
        PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, shard_tokens=2000), data_dir, workers=2
    )
    assert "already prepared" in capsys.readouterr().out
    assert again == read_manifest(data_dir)


def test_crashed_prepare_resumes_and_skips_finished_shards(corpus_dir, tmp_path, monkeypatch, data_dir):
    import gptforge.data.prepare as prep

    real = prep.documents

    def crashing(source, field, **kw):
        for i, doc in enumerate(real(source, field, **kw)):
            if i == 40:
                raise RuntimeError("simulated crash")
            yield doc

    monkeypatch.setattr(prep, "documents", crashing)
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 4)  # the 40 documents before the crash make whole batches
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, shard_tokens=2000), tmp_path, workers=1)
    progress = json.loads((tmp_path / "progress.json").read_text())
    finished = {s["file"]: (tmp_path / s["file"]).stat().st_mtime_ns for s in progress["shards"]}
    assert finished and not (tmp_path / "manifest.json").exists()

    monkeypatch.setattr(prep, "documents", real)
    resumed = prepare(
        PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, shard_tokens=2000), tmp_path, workers=1
    )
    clean = read_manifest(data_dir)
    assert [(s["file"], s["sha256"]) for s in resumed["shards"]] == [(s["file"], s["sha256"]) for s in clean["shards"]]
    assert resumed["splits"] == clean["splits"]
    assert all((tmp_path / f).stat().st_mtime_ns == t for f, t in finished.items())  # not rewritten
    assert not (tmp_path / "progress.json").exists()


def test_decontamination_drops_overlapping_training_documents(corpus_dir, tmp_path):
    victim = (corpus_dir / "mod_005.py").read_text()
    words = " ".join(victim.split()[:20])  # a 13-gram (and more) of one training document
    evals = tmp_path / "hellaswag.jsonl"
    evals.write_text(
        json.dumps({"ctx": "Some context.", "endings": [words.upper() + "!!", "other"], "label": 0}) + "\n"
    )
    clean = prepare(PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1), tmp_path / "clean", workers=1)
    dec = prepare(
        PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, decontaminate=[str(evals)]),
        tmp_path / "dec",
        workers=1,
    )
    assert dec["decontamination"]["dropped_docs"] >= 1
    assert dec["splits"]["train"]["docs"] == clean["splits"]["train"]["docs"] - dec["decontamination"]["dropped_docs"]
    tok = load_tokenizer("gpt2")

    def train_text(m, folder):
        return "".join(
            tok.decode(read_shard(folder / s["file"]).tolist()) for s in m["shards"] if s["split"] == "train"
        )

    assert victim in train_text(clean, tmp_path / "clean")
    assert victim not in train_text(dec, tmp_path / "dec")


def _tiny(root, n=3):
    """A few small documents: quick to prepare in one process."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i}.txt").write_text(f"document {i} " * 20)
    return root


def test_an_out_inside_the_source_is_refused_and_a_data_folder_in_a_source_is_not_read(tmp_path):
    import shutil

    from gptforge.data.sources import documents

    src = _tiny(tmp_path / "src")
    with pytest.raises(GptforgeError, match=rf"^--out {src / 'sub'}: inside {src}, which this command reads;"):
        prepare(
            PrepareSettings.from_flags(str(src), val_fraction=0), src / "sub", workers=1
        )  # the next prepare of src would read it
    assert not (src / "sub").exists()
    prepare(PrepareSettings.from_flags(str(src), val_fraction=0), tmp_path / "data", workers=1)
    shutil.move(tmp_path / "data", src / "data")  # put there some other way: its report.md is no training text
    (src / "notes").mkdir()
    (src / "notes" / "manifest.json").write_text('{"settings": "of another tool"}')
    (src / "notes" / "a.md").write_text("read")
    assert [name for name, _ in documents(str(src))] == ["doc0.txt", "doc1.txt", "doc2.txt", "notes/a.md"]


def test_a_changed_corpus_is_not_called_already_prepared(tmp_path, capsys):
    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    (src / "doc1.txt").write_text("a changed document " * 20)
    changed = r"SOURCE changed: 3 files of 660 bytes \(digest \w+\) then, 3 files of 820 bytes \(digest \w+\) now"
    with pytest.raises(
        GptforgeError, match=rf"out: holds data prepared with other settings \({changed}\); pass --force"
    ):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    assert (
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1, force=True)["splits"]["train"][
            "bytes"
        ]
        == 820
    )
    capsys.readouterr()
    prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    assert "already prepared" in capsys.readouterr().out


def test_ext_takes_a_value_starting_with_a_dash():
    from gptforge.cli.parser import build_parser

    args = build_parser().parse_args(["prepare", "src", "--ext", "-md", "--out", "o", "--ext", "+go,-md"])
    assert args.ext == "+go,-md" and args.out == "o"
    assert build_parser().parse_args(["prepare", "src", "--out", "o", "--ext", "-py"]).ext == "-py"


def test_out_holding_other_files_is_refused_unless_forced(tmp_path):
    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GptforgeError, match=r"--out .*out: exists and is not empty; .*--force"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1, force=True)
    assert not (out / "notes.txt").exists() and read_manifest(out)["splits"]["train"]["docs"] == 3
    assert not list(tmp_path.glob(".out.*")), "the temp folder was swapped in"


@pytest.mark.parametrize("out", ["src", ".", "src/.."])
def test_never_writes_into_the_folder_it_reads(tmp_path, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    _tiny(tmp_path / "src")
    with pytest.raises(GptforgeError, match=r"--out .*: (is|contains) src, which this command reads"):
        prepare(PrepareSettings.from_flags("src"), out, workers=1, force=True)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["doc0.txt", "doc1.txt", "doc2.txt"]


def test_other_settings_are_refused_then_replaced_whole_with_force(tmp_path, monkeypatch, capsys):
    import gptforge.data.prepare as prep

    src, out = _tiny(tmp_path / "src", 12), tmp_path / "out"
    old = prepare(PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=50), out, workers=1)
    with pytest.raises(
        GptforgeError, match=r"out: holds data prepared with other settings \(--val-fraction was 0, now 0.5\)"
    ):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0.5, shard_tokens=50), out, workers=1)
    with pytest.raises(GptforgeError, match=r"\(--shard-tokens was 50, now 60\)"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=60), out, workers=1)

    real = prep.documents

    def crashing(source, field, **kw):
        for i, doc in enumerate(real(source, field, **kw)):
            if i == 8:
                raise RuntimeError("killed")  # midway through the replacement
            yield doc

    monkeypatch.setattr(prep, "documents", crashing)
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 1)
    with pytest.raises(RuntimeError, match="killed"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0.5, shard_tokens=50), out, workers=1, force=True)
    assert read_manifest(out) == old  # the old data is whole, and still what train reads
    assert all(read_shard(out / s["file"]).size == s["tokens"] for s in old["shards"])

    monkeypatch.setattr(prep, "documents", real)
    capsys.readouterr()
    new = prepare(PrepareSettings.from_flags(str(src), val_fraction=0.5, shard_tokens=50), out, workers=1, force=True)
    assert "resuming" in capsys.readouterr().out  # the killed replacement picks up where it stopped
    assert read_manifest(out) == new and new["splits"]["val"]["docs"] > 0
    own = ["manifest.json", "report.md", "removed.jsonl", *(s["file"] for s in new["shards"])]
    assert sorted(p.name for p in out.iterdir()) == sorted(own)
    assert not list(tmp_path.glob(".out.*"))


def test_force_with_the_same_settings_rebuilds(tmp_path, capsys):
    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    first = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    (out / first["shards"][0]["file"]).write_bytes(b"damaged")
    assert prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1, force=True) == first
    assert "already prepared" not in capsys.readouterr().out
    assert read_shard(out / first["shards"][0]["file"]).size == first["shards"][0]["tokens"]


def test_a_second_prepare_into_the_same_folder_is_refused_naming_the_pid(tmp_path):
    with lock_held_elsewhere(tmp_path / "out", "prepare") as pid:  # as a running prepare holds it
        busy = rf"out: in use by another gptforge prepare \(pid {pid}\)"
        with pytest.raises(GptforgeError, match=busy):
            prepare(PrepareSettings.from_flags(str(_tiny(tmp_path / "src"))), tmp_path / "out", workers=1)


def test_unfinished_prepare_is_marked_from_the_start(tmp_path, monkeypatch):
    import gptforge.data.prepare as prep

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # killed before the first shard

    monkeypatch.setattr(prep, "_tokenize", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareSettings.from_flags(str(_tiny(tmp_path / "src"))), tmp_path / "out", workers=1)
    with pytest.raises(GptforgeError, match=r"out: unfinished prepare; run `gptforge prepare` again to finish it"):
        read_manifest(tmp_path / "out")
    monkeypatch.undo()
    # Nothing was written yet, so other settings just start over, without --force.
    assert (
        prepare(PrepareSettings.from_flags(str(tmp_path / "src"), val_fraction=0), tmp_path / "out", workers=1)[
            "splits"
        ]["val"]["docs"]
        == 0
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"train_tokenizer": 0}, "--train-tokenizer 0: expected a vocabulary size of at least 257"),
        ({"train_tokenizer": -5}, "--train-tokenizer -5: expected"),
        ({"train_tokenizer": 256}, "--train-tokenizer 256: expected"),
        (
            {"train_tokenizer": 10**9},
            "--train-tokenizer 1000000000: expected a vocabulary size of at most 1,048,576",
        ),
        ({"train_tokenizer": 300, "tokenizer": "t.json"}, "--tokenizer t.json and --train-tokenizer 300: pass one"),
        ({"val_fraction": 1.0}, r"--val-fraction must be in \[0, 1\), got 1.0"),
        ({"val_fraction": -0.1}, r"--val-fraction must be in \[0, 1\), got -0.1"),
        ({"shard_tokens": 0}, "--shard-tokens must be positive, got 0"),
        ({"workers": 0}, "--workers must be positive, got 0"),
        ({"workers": -2}, "--workers must be positive, got -2"),
    ],
)
def test_bad_flags_are_refused_before_any_work(tmp_path, flags, message):
    workers = flags.pop("workers", None)
    with pytest.raises(GptforgeError, match=message):
        prepare(PrepareSettings.from_flags(str(tmp_path), **flags), tmp_path / "out", workers=workers)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"tokenizer": "missing.json"}, "unknown tokenizer 'missing.json'"),
        ({"decontaminate": ["missing.jsonl"]}, r"missing\.jsonl: cannot read"),
        ({"text_field": "body"}, r"d\.jsonl:1: expected a JSON object with a string field 'body'"),
    ],
)
def test_a_flag_found_wrong_while_reading_fails_before_the_folder_exists(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    with pytest.raises(GptforgeError, match=message):
        prepare(PrepareSettings.from_flags("d.jsonl", **flags), "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_prepare_that_failed_midway_is_started_over_by_the_corrected_command(tmp_path, monkeypatch):
    import gptforge.data.prepare as prep

    src, out = _tiny(tmp_path / "src", 12), tmp_path / "out"
    out.mkdir()  # a folder that existed before is left as the failed run made it (a new one would be removed)
    with pytest.raises(GptforgeError, match="all held out for validation"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0.9999999, shard_tokens=50), out, workers=1)
    assert json.loads((out / "progress.json").read_text())["shards"], "it had written shards"
    fixed = prepare(
        PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=50), out, workers=1
    )  # no --force needed
    left = sorted(p.name for p in out.iterdir() if p.name != ".lock")
    # no shard of the failed one
    assert left == sorted(["manifest.json", "report.md", "removed.jsonl", *(s["file"] for s in fixed["shards"])])

    killed, real = tmp_path / "killed", prep.documents  # a killed prepare keeps its shards for the same command

    def interrupted(source, field, **kw):
        for i, doc in enumerate(real(source, field, **kw)):
            if i == 8:
                raise RuntimeError("killed")  # as a kill midway would stop it
            yield doc

    monkeypatch.setattr(prep, "documents", interrupted)
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 1)
    with pytest.raises(RuntimeError, match="killed"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=50), killed, workers=1)
    with pytest.raises(GptforgeError, match=r"killed: holds an unfinished prepare with other settings"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=60), killed, workers=1)


def test_disk_full_is_one_line_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    import errno

    import gptforge.data.shards as shards

    src, out = _tiny(tmp_path / "src", 12), tmp_path / "out"
    clean = prepare(
        PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=50), tmp_path / "clean", workers=1
    )
    real, calls = shards.write_shard, []

    def full_disk(path, tokens):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tokens)

    monkeypatch.setattr(shards, "write_shard", full_disk)
    monkeypatch.setattr(pipeline, "BATCH_DOCS", 1)
    with pytest.raises(GptforgeError, match=rf"^cannot write {out}: No space left on device; fix that and run"):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=50), out, workers=1)
    progress = json.loads((out / "progress.json").read_text())
    assert [s["file"] for s in progress["shards"]] == ["train_000000.bin", "train_000001.bin"]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "progress.json", "train_000000.bin", "train_000001.bin"]

    monkeypatch.setattr(shards, "write_shard", real)
    capsys.readouterr()
    assert (
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0, shard_tokens=50), out, workers=1)["shards"]
        == clean["shards"]
    )
    assert "resuming: 2 shard(s)" in capsys.readouterr().out


WAIT = "wait for it to end or stop it\n"


def test_cli_refusals_are_one_line(tmp_path):
    import os
    import subprocess

    from tests.helpers import cli

    from gptforge.outputs import locked

    src, out = _tiny(tmp_path / "src"), tmp_path / "out"

    def run(*args):
        proc = subprocess.run(
            cli("prepare", src, "--out", out, "--workers", "1", "--val-fraction", "0", *args),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return proc.returncode, proc.stderr

    assert run()[0] == 0
    code, err = run("--train-tokenizer", "0")
    assert (
        code == 1
        and err == "gptforge prepare: error: --train-tokenizer 0: expected a vocabulary size of at least 257\n"
    )
    code, err = run("--seed", "3")
    assert code == 1 and err.count("\n") == 1 and "(--seed was 0, now 3); pass --force" in err
    with locked(out, "prepare"):
        code, err = run("--seed", "3", "--force")
    assert (
        code == 1
        and err == f"gptforge prepare: error: {out}: in use by another gptforge prepare (pid {os.getpid()}); {WAIT}"
    )
    assert run("--seed", "3", "--force")[0] == 0 and read_manifest(out)["seed"] == 3


# Run in a subprocess: the real CLI, with a source that never ends so Ctrl-C always lands mid-run.
# A background job of a non-interactive shell (CI started with `&`) inherits SIGINT ignored: a terminal's would not.
ENDLESS_PREPARE = """
import itertools, signal, sys, time
import gptforge.data.pipeline as pipeline
import gptforge.data.prepare as prep
from gptforge.cli import main

signal.signal(signal.SIGINT, signal.default_int_handler)

def endless(source, field, **kw):
    for i in itertools.count():
        time.sleep(0.002)
        yield f"doc{i}", f"document {i} " * 50

prep.documents, pipeline.BATCH_DOCS = endless, 8
sys.exit(main(sys.argv[1:]))
"""


def _shards_saved(out):
    try:
        return len(json.loads((out / "progress.json").read_text())["shards"])
    except (OSError, ValueError, KeyError):  # not written yet
        return 0


def test_ctrl_c_stops_the_workers_quietly_and_leaves_a_resumable_folder(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    args = ["prepare", src, "--out", out, "--workers", "2", "--val-fraction", "0", "--shard-tokens", "2000"]
    proc = subprocess.Popen(
        [sys.executable, "-c", ENDLESS_PREPARE, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C signals the whole foreground one
    )
    try:
        deadline = time.monotonic() + 60
        while _shards_saved(out) < 5:  # both workers have returned batches by then
            if proc.poll() is not None:
                pytest.fail(f"prepare ended early: {proc.stderr.read()}")
            assert time.monotonic() < deadline, "no shards saved within 60 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err and err.endswith("interrupted\n"), err
    assert json.loads((out / "progress.json").read_text())["shards"]  # what a re-run resumes from


def test_workers_are_capped_at_the_cpu_count(tmp_path, monkeypatch, capsys):
    ctx, sizes = pipeline.mp.get_context("spawn"), []
    real_pool = ctx.Pool

    def pool(processes, *args):
        sizes.append(processes)
        return real_pool(processes, *args)

    monkeypatch.setattr(ctx, "Pool", pool)
    monkeypatch.setattr(pipeline, "cpu_count", lambda: 1)
    prepare(PrepareSettings.from_flags(str(_tiny(tmp_path / "src")), val_fraction=0), tmp_path / "out", workers=500)
    assert sizes == [1] and "using 1 workers: this machine has 1 CPUs\n" in capsys.readouterr().out
    monkeypatch.setattr(pipeline, "cpu_count", lambda: 2)
    assert [pipeline.worker_count(n) for n in (None, 1, 2)] == [2, 1, 2]
    assert "using" not in capsys.readouterr().out
    assert pipeline.worker_count(3) == 2 and capsys.readouterr().out == "using 2 workers: this machine has 2 CPUs\n"


def test_a_tokenizer_file_inside_out_is_refused_even_with_force(tmp_path):
    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    prepare(PrepareSettings.from_flags(str(src), val_fraction=0, train_tokenizer=300), tmp_path / "bpe", workers=1)
    out.mkdir()
    (out / "mine.json").write_bytes((tmp_path / "bpe" / "tokenizer.json").read_bytes())
    with pytest.raises(GptforgeError, match=r"^--out .*out: contains .*mine.json, which this command reads; write"):
        prepare(
            PrepareSettings.from_flags(str(src), tokenizer=str(out / "mine.json"), val_fraction=0),
            out,
            workers=1,
            force=True,
        )
    assert [p.name for p in out.iterdir()] == ["mine.json"]


def test_a_finished_folder_that_cannot_be_locked_is_still_reported_prepared(tmp_path, monkeypatch, capsys):
    import gptforge.data.prepare as prep

    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    first = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    capsys.readouterr()

    def read_only(folder, what):  # as on a read-only folder (tests run as root, where chmod does not stop writes)
        raise PermissionError(13, "Permission denied", str(folder / ".lock"))

    monkeypatch.setattr(prep, "locked", read_only)
    assert prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1) == first
    assert capsys.readouterr().out == f"{out}: already prepared with these settings\n"
    with pytest.raises(GptforgeError, match=rf"^cannot write {out}: Permission denied; fix that"):
        prepare(
            PrepareSettings.from_flags(str(src), val_fraction=0, seed=1), out, workers=1, force=True
        )  # other settings still need the lock


def test_temp_files_a_kill_left_are_removed_on_resume_and_on_a_finished_folder(tmp_path, monkeypatch):
    import gptforge.data.prepare as prep

    src, out = _tiny(tmp_path / "src"), tmp_path / "out"
    stale = [".progress.json.tmp.4242", ".manifest.json.tmp.17", ".tokenizer.json.tmp.5", ".train_000000.bin.tmp.9"]
    stale.append(".removed.jsonl.tmp.3")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # killed mid-run, after writing progress.json

    monkeypatch.setattr(prep, "_tokenize", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)
    monkeypatch.undo()
    for name in [*stale, ".notes.txt.tmp.1"]:
        (out / name).write_text("torn")
    manifest = prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1)  # resumes, then finishes
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            ".lock",
            ".notes.txt.tmp.1",
            "manifest.json",
            "report.md",
            "removed.jsonl",
            *(s["file"] for s in manifest["shards"]),
        ]
    )
    for name in stale:  # a kill -9 after the manifest, mid-write of one of these
        (out / name).write_text("torn")
    assert prepare(PrepareSettings.from_flags(str(src), val_fraction=0), out, workers=1) == manifest
    assert not any((out / name).exists() for name in stale) and (out / ".notes.txt.tmp.1").exists()
