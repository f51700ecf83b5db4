import json

import numpy as np
import pytest

from gptforge.data.shards import HEADER_BYTES, MAGIC, read_manifest, read_shard, verify_shard, write_shard
from gptforge.errors import GptforgeError


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_round_trip(tmp_path, dtype):
    tokens = np.random.default_rng(0).integers(0, 60000, size=1000).astype(dtype)
    write_shard(tmp_path / "s.bin", tokens)
    back = read_shard(tmp_path / "s.bin", vocab_size=60000)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, tokens)
    header = np.fromfile(tmp_path / "s.bin", dtype=np.int32, count=3)
    assert header.tolist() == [MAGIC, 1 if dtype == np.uint16 else 2, 1000]
    assert not list(tmp_path.glob(".*tmp*")), "temp files must be renamed away"


def test_truncated_shard_is_named(tmp_path):
    write_shard(tmp_path / "s.bin", np.arange(100, dtype=np.uint16))
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "s.bin").write_bytes(data[:-10])
    with pytest.raises(GptforgeError, match=r"s\.bin: header says 100 tokens .*truncated"):
        read_shard(tmp_path / "s.bin")


def test_wrong_magic(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0" * (HEADER_BYTES + 8))
    with pytest.raises(GptforgeError, match=r"x\.bin: not a token shard"):
        read_shard(tmp_path / "x.bin")


def test_token_id_beyond_vocab(tmp_path):
    write_shard(tmp_path / "s.bin", np.array([1, 2, 500], dtype=np.uint16))
    with pytest.raises(GptforgeError, match="token id 500 >= vocab size 100"):
        read_shard(tmp_path / "s.bin", vocab_size=100)


def test_missing_manifest(tmp_path):
    with pytest.raises(GptforgeError, match="no manifest.json"):
        read_manifest(tmp_path)


GOOD = {
    "tokenizer": {"name": "gpt2", "vocab_size": 50257, "eot": 50256},
    "shards": [{"file": "train_000000.bin", "split": "train", "tokens": 3}],
    "splits": {"train": {"docs": 1, "tokens": 3, "bytes": 9}},
}


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"[]", "a JSON list, expected an object"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text"),
        ("{'tokenizer': 'ß'}".encode("latin-1"), "not UTF-8 text"),
        (b"\x00\x01\x02", "Expecting value"),
        (json.dumps({"shards": []}).encode(), "no 'tokenizer.name'"),
        (json.dumps({**GOOD, "tokenizer": {"name": "gpt2"}}).encode(), "'tokenizer.vocab_size' is None"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "shards"}).encode(), "no 'shards' list"),
        (json.dumps({**GOOD, "shards": [{"split": "train"}]}).encode(), r"shards\[0\] has no 'file'"),
        (json.dumps({**GOOD, "shards": [{"file": "a.bin", "split": "test"}]}).encode(), r"shards\[0\].split is 'test'"),
        (json.dumps({**GOOD, "splits": {}}).encode(), "no 'splits.train' with 'tokens' and 'bytes'"),
        (json.dumps({**GOOD, "chat": "yes"}).encode(), "'chat' is 'yes', expected an object with a 'special_tokens'"),
        (json.dumps({**GOOD, "chat": {"special_tokens": ["<|im_start|>", "<|im_end|>"]}}).encode(), "has no 'mask'"),
    ],
)
def test_malformed_manifest_names_the_problem(tmp_path, content, problem):
    (tmp_path / "manifest.json").write_bytes(content)
    with pytest.raises(
        GptforgeError, match=rf"manifest\.json: malformed manifest \(.*{problem}.*\); run `gptforge prepare` again"
    ):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(GOOD))
    assert read_manifest(tmp_path) == GOOD


def test_unfinished_prepare_is_never_read_as_llmc_shards(tmp_path):
    write_shard(tmp_path / "train_000000.bin", np.arange(100, dtype=np.uint16))
    assert read_manifest(tmp_path)["format"] == "foreign"  # a folder of llm.c shards is read as one
    (tmp_path / "progress.json").write_text("{}")
    with pytest.raises(GptforgeError, match=r"unfinished prepare; run `gptforge prepare` again to finish it"):
        read_manifest(tmp_path)


def test_a_shard_with_other_tokens_of_the_same_size_fails_its_checksum(tmp_path):
    sha = write_shard(tmp_path / "s.bin", np.arange(100, dtype=np.uint16))
    verify_shard(tmp_path / "s.bin", sha)
    write_shard(tmp_path / "s.bin", np.arange(1, 101, dtype=np.uint16))
    with pytest.raises(GptforgeError, match=r"s\.bin: checksum mismatch .*prepare the data again with --force"):
        verify_shard(tmp_path / "s.bin", sha)
