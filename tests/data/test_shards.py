import json

import numpy as np
import pytest

from gptforge.data.shards import HEADER_BYTES, MAGIC, read_manifest, read_shard, write_shard
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


def test_missing_and_malformed_manifest(tmp_path):
    with pytest.raises(GptforgeError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": []}))
    with pytest.raises(GptforgeError, match="malformed manifest"):
        read_manifest(tmp_path)
