import json

import numpy as np
import pytest

from gptforge.data.prepare import prepare
from gptforge.data.shards import read_manifest, read_shard
from gptforge.data.tokenizer import load_tokenizer
from gptforge.errors import GptforgeError


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
    again = prepare(str(corpus_dir), tmp_path, val_fraction=0.1, shard_tokens=2000, workers=1)
    assert again["shards"] == read_manifest(data_dir)["shards"]  # same files, same sha256


def test_empty_corpus(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blank.txt").write_text("   \n")
    with pytest.raises(GptforgeError, match="empty corpus"):
        prepare(str(tmp_path / "src"), tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_missing_source(tmp_path):
    with pytest.raises(GptforgeError, match="no such file or directory"):
        prepare(str(tmp_path / "nope"), tmp_path / "out", workers=1)


def test_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(GptforgeError, match=r"d\.jsonl:2: expected a JSON object with a string field 'text'"):
        prepare(str(tmp_path / "d.jsonl"), tmp_path / "out", workers=1)


def test_trained_tokenizer_is_used_end_to_end(corpus_dir, tmp_path):
    from gptforge.checkpoint import load_checkpoint
    from gptforge.config import load_config
    from gptforge.model.generate import generate
    from gptforge.train.trainer import train

    m = prepare(str(corpus_dir), tmp_path / "data", val_fraction=0.1, workers=1, train_tokenizer=320)
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


def test_shards_end_at_document_boundaries(data_dir):
    m = read_manifest(data_dir)
    for shard in m["shards"]:
        tokens = read_shard(data_dir / shard["file"])
        assert tokens[0] == 50256  # every shard starts with a document's EOT
        assert int((tokens == 50256).sum()) == shard["docs"]


def test_second_prepare_is_a_no_op(corpus_dir, data_dir, capsys):
    again = prepare(str(corpus_dir), data_dir, val_fraction=0.1, shard_tokens=2000, workers=2)
    assert "already prepared" in capsys.readouterr().out
    assert again == read_manifest(data_dir)


def test_crashed_prepare_resumes_and_skips_finished_shards(corpus_dir, tmp_path, monkeypatch, data_dir):
    import gptforge.data.prepare as prep

    real = prep.documents

    def crashing(source, field):
        for i, doc in enumerate(real(source, field)):
            if i == 40:
                raise RuntimeError("simulated crash")
            yield doc

    monkeypatch.setattr(prep, "documents", crashing)
    monkeypatch.setattr(prep, "BATCH_DOCS", 4)  # the 40 documents before the crash make whole batches
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(str(corpus_dir), tmp_path, val_fraction=0.1, shard_tokens=2000, workers=1)
    progress = json.loads((tmp_path / "progress.json").read_text())
    finished = {s["file"]: (tmp_path / s["file"]).stat().st_mtime_ns for s in progress["shards"]}
    assert finished and not (tmp_path / "manifest.json").exists()

    monkeypatch.setattr(prep, "documents", real)
    resumed = prepare(str(corpus_dir), tmp_path, val_fraction=0.1, shard_tokens=2000, workers=1)
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
    clean = prepare(str(corpus_dir), tmp_path / "clean", val_fraction=0.1, workers=1)
    dec = prepare(str(corpus_dir), tmp_path / "dec", val_fraction=0.1, workers=1, decontaminate=[str(evals)])
    assert dec["decontamination"]["dropped_docs"] >= 1
    assert dec["splits"]["train"]["docs"] == clean["splits"]["train"]["docs"] - dec["decontamination"]["dropped_docs"]
    tok = load_tokenizer("gpt2")

    def train_text(m, folder):
        return "".join(
            tok.decode(read_shard(folder / s["file"]).tolist()) for s in m["shards"] if s["split"] == "train"
        )

    assert victim in train_text(clean, tmp_path / "clean")
    assert victim not in train_text(dec, tmp_path / "dec")
