import numpy as np
import pytest

from gptforge.data.prepare import prepare
from gptforge.data.shards import read_manifest, read_shard
from gptforge.errors import GptforgeError
from gptforge.tokenizer import load_tokenizer


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
    from gptforge.generate import generate
    from gptforge.trainer import train

    m = prepare(str(corpus_dir), tmp_path / "data", val_fraction=0.1, workers=1, train_tokenizer=320)
    assert m["tokenizer"]["name"] == "tokenizer.json" and m["tokenizer"]["vocab_size"] <= 320
    tok = load_tokenizer("tokenizer.json", tmp_path / "data")
    train_stream = read_shard(tmp_path / "data" / "train_000000.bin", tok.vocab_size)
    first_doc = tok.decode(train_stream[1:200].tolist()).split("<|endoftext|>")[0]
    assert first_doc in {p.read_text() for p in corpus_dir.glob("*.py")}  # decodes back to a source file

    cfg = load_config("tiny", [f"data.path={tmp_path / 'data'}", "train.max_steps=2"])
    result = train(cfg, tmp_path / "run")
    assert cfg.model.vocab_size == tok.vocab_size
    model, ckpt_tok, _, _ = load_checkpoint(result.checkpoint)
    assert (result.checkpoint / "tokenizer.json").is_file()  # the checkpoint carries its tokenizer
    assert ckpt_tok.encode("def add_all_1(values):") == tok.encode("def add_all_1(values):")
    new = generate(model, ckpt_tok.encode("def"), 5, temperature=0)[0]
    assert all(0 <= t < tok.vocab_size for t in new)
