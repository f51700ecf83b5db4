import time

import pytest
from tests.data.test_loader import make_data

from gptforge.data.loader import TokenLoader
from gptforge.data.prefetch import Prefetcher


def test_prefetched_batches_and_resume_point_match_the_plain_loader(tmp_path):
    """The thread reads ahead, yet the saved position is right after the last batch handed out."""
    make_data(tmp_path, [64, 64, 64])
    plain = TokenLoader(tmp_path, "train", 2, 8, seed=1)
    expected = [plain.next_batch()[0] for _ in range(30)]  # crosses several epochs
    with Prefetcher(TokenLoader(tmp_path, "train", 2, 8, seed=1), depth=8) as batches:
        got = [batches.next_batch()[0] for _ in range(13)]
        time.sleep(0.05)  # let the thread run ahead
        assert batches.loader.state_dict() != batches.state_dict()
        state = batches.state_dict()
    resumed = TokenLoader(tmp_path, "train", 2, 8, seed=999)
    resumed.load_state_dict(state)
    with Prefetcher(resumed) as batches:
        got += [batches.next_batch()[0] for _ in range(17)]
    for a, b in zip(expected, got, strict=True):
        assert (a == b).all()


def test_a_loader_error_reaches_the_training_loop(tmp_path):
    make_data(tmp_path, [64])
    loader = TokenLoader(tmp_path, "train", 2, 8)
    loader.shards[0] = None  # the next read fails inside the thread
    with Prefetcher(loader) as batches, pytest.raises(TypeError):
        batches.next_batch()
