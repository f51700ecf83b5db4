import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gptforge.data.loader import TokenLoader
from gptforge.data.shards import write_manifest, write_shard
from gptforge.errors import GptforgeError


def make_data(tmp_path, shard_sizes, vocab=60000, split="train"):
    """Shards whose tokens are their global positions, so a window tells where it came from."""
    shards, start = [], 0
    for i, n in enumerate(shard_sizes):
        sha = write_shard(tmp_path / f"{split}_{i:06d}.bin", np.arange(start, start + n, dtype=np.uint32) % vocab)
        shards.append({"file": f"{split}_{i:06d}.bin", "split": split, "tokens": n, "sha256": sha})
        start += n
    write_manifest(
        tmp_path,
        {
            "tokenizer": {"name": "gpt2", "vocab_size": vocab, "eot": 0},
            "shards": shards,
            "splits": {split: {"docs": 1, "tokens": start, "bytes": start}},
        },
    )
    return tmp_path


@pytest.mark.parametrize("B,T,world,sizes", [(2, 8, 1, [50, 37, 100]), (3, 5, 2, [7, 7, 7, 90]), (1, 16, 3, [200])])
def test_epoch_serves_each_window_once_across_ranks(tmp_path, B, T, world, sizes):
    make_data(tmp_path, sizes)
    loaders = [TokenLoader(tmp_path, "train", B, T, rank=r, world_size=world, seed=3) for r in range(world)]
    seen = []
    for _ in range(loaders[0].batches_per_epoch):
        for ld in loaders:
            x, y = ld.next_batch()
            assert x.shape == y.shape == (B, T)
            assert (x[:, 1:] == y[:, :-1]).all() and ((y - x) == 1).all()  # y is x shifted by one
            seen += [int(row[0]) // T for row in x]
    n_windows = (sum(sizes) - 1) // T
    assert len(seen) == len(set(seen)) == loaders[0].batches_per_epoch * B * world
    assert set(seen) <= set(range(n_windows))
    assert n_windows - len(seen) < B * world  # only the tail that cannot fill a global batch is skipped


def test_resume_yields_the_same_batches(tmp_path):
    make_data(tmp_path, [64, 64, 64])
    straight = TokenLoader(tmp_path, "train", 2, 8, seed=1)
    expected = [straight.next_batch()[0] for _ in range(30)]  # crosses several epochs
    first = TokenLoader(tmp_path, "train", 2, 8, seed=1)
    got = [first.next_batch()[0] for _ in range(13)]
    resumed = TokenLoader(tmp_path, "train", 2, 8, seed=999)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next_batch()[0] for _ in range(17)]
    for a, b in zip(expected, got, strict=True):
        assert (a == b).all()


def test_epochs_are_reshuffled(tmp_path):
    make_data(tmp_path, [401])  # 50 windows of 8: ten whole batches of 5, nothing left over
    ld = TokenLoader(tmp_path, "train", 5, 8, seed=0)
    epoch0 = [ld.next_batch()[0][:, 0].tolist() for _ in range(ld.batches_per_epoch)]
    epoch1 = [ld.next_batch()[0][:, 0].tolist() for _ in range(ld.batches_per_epoch)]
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, []))


def served(loaders, steps, accum):
    """The windows (first tokens) each of `steps` optimizer steps takes from `loaders` (one per rank)."""
    return [
        sorted(row for _ in range(accum) for ld in loaders for row in ld.next_batch()[0][:, 0].tolist())
        for _ in range(steps)
    ]


def test_a_position_resumes_on_another_number_of_processes_or_micro_batch_from_the_same_window(tmp_path):
    make_data(tmp_path, [8 * 404 + 1])  # 404 windows of 8; a step takes 16: every epoch is 25 steps, 4 left over
    shape = {"seed": 3, "step_windows": 16}

    def ranks(batch, world):
        return [TokenLoader(tmp_path, "train", batch, 8, r, world, **shape) for r in range(world)]

    straight = served(ranks(4, 2), 60, accum=2)  # crosses two epoch ends
    for batch, world in ((4, 1), (2, 4), (8, 2), (16, 1)):
        first = ranks(4, 2)
        got = served(first, 7, accum=2)
        resumed = ranks(batch, world)
        for ld in resumed:
            ld.load_state_dict(first[0].state_dict())
        got += served(resumed, 53, accum=16 // (batch * world))
        assert got == straight, (batch, world)
    odd = TokenLoader(tmp_path, "train", 4, 8)
    odd.next_batch()  # 4 windows in: half a batch of 8
    with pytest.raises(GptforgeError, match="stopped 4 windows into an epoch, not a whole number of global batches"):
        TokenLoader(tmp_path, "train", 8, 8).load_state_dict(odd.state_dict())
    with pytest.raises(GptforgeError, match="saved with windows of 8 tokens, now 4"):
        TokenLoader(tmp_path, "train", 4, 4).load_state_dict(TokenLoader(tmp_path, "train", 4, 8).state_dict())


@pytest.mark.parametrize(("split", "remedy"), [("train", "add data"), ("val", "a larger --val-fraction")])
def test_too_little_data_says_what_to_do(tmp_path, split, remedy):
    """A small chat or filtered set met this with no way out named: its val split is 1% of what was kept."""
    make_data(tmp_path, [20], split=split)
    with pytest.raises(GptforgeError, match=rf"has 20 tokens, too few for one batch of 4 x 9 tokens .*{remedy}"):
        TokenLoader(tmp_path, split, 4, 8)


def test_too_little_data_at_a_micro_batch_of_1_names_the_block_size(tmp_path):
    """At a micro-batch of 1, "or use a smaller micro-batch" named a way out that does not exist."""
    make_data(tmp_path, [20])
    with pytest.raises(
        GptforgeError, match=r"1 x 33 tokens x 1 rank\(s\) \(add data, or use a smaller model.block_size\)"
    ):
        TokenLoader(tmp_path, "train", 1, 32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 9),
    world=st.integers(1, 4),
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    seed=st.integers(0, 3),
)
def test_property_every_window_served_once_per_epoch(tmp_path_factory, B, T, world, sizes, seed):
    total = sum(sizes)
    assume((total - 1) // T >= B * world)
    data = make_data(tmp_path_factory.mktemp("p"), sizes)
    loaders = [TokenLoader(data, "train", B, T, rank=r, world_size=world, seed=seed) for r in range(world)]
    starts = []
    for _ in range(loaders[0].batches_per_epoch):
        for ld in loaders:
            x, y = ld.next_batch()
            assert ((y - x) == 1).all()  # windows are contiguous, across shard boundaries too
            starts += x[:, 0].tolist()
    n_windows = (total - 1) // T
    assert len(starts) == len(set(starts)) == (n_windows // (B * world)) * B * world
    assert all(s % T == 0 and s // T < n_windows for s in starts)


def test_build_nanogpt_npy_folder_without_manifest(tmp_path):
    np.save(tmp_path / "edufineweb_val_000000.npy", np.arange(100, dtype=np.uint16))
    np.save(tmp_path / "edufineweb_train_000001.npy", np.arange(100, 400, dtype=np.uint16))
    train = TokenLoader(tmp_path, "train", 2, 10, shuffle=False)
    x, y = train.next_batch()
    assert x[0, 0] == 100 and train.n_windows == 29
    val = TokenLoader(tmp_path, "val", 2, 10, shuffle=False)
    assert val.next_batch()[0][0, 0] == 0
    np.save(tmp_path / "edufineweb_train_000002.npy", np.zeros((2, 2), dtype=np.uint16))
    with pytest.raises(GptforgeError, match=r"000002\.npy: expected a 1-D uint16/uint32 token array"):
        TokenLoader(tmp_path, "train", 2, 10)


def test_a_changed_shard_is_refused_without_holding_up_batches(tmp_path, monkeypatch):
    import threading

    import gptforge.data.loader as loader_module

    make_data(tmp_path, [64, 64])
    TokenLoader(tmp_path, "train", 2, 8).verify()
    write_shard(tmp_path / "train_000001.bin", np.arange(1, 65, dtype=np.uint32))  # other tokens, same size
    served, real = threading.Event(), loader_module.verify_shard

    def verify_once_a_batch_is_served(path, sha):
        # No race with the machine's load: the checksums wait for the test's handshake; only a loader whose first
        # batch waits for them runs out this bound, and then fails on the error below instead of hanging.
        if not served.wait(60):
            raise AssertionError("the first batch waited for the checksums")
        return real(path, sha)

    monkeypatch.setattr(loader_module, "verify_shard", verify_once_a_batch_is_served)
    loader = TokenLoader(tmp_path, "train", 2, 8, seed=1)
    loader.next_batch()  # served while the checksums are still being computed
    served.set()
    with pytest.raises(GptforgeError, match=r"train_000001\.bin: checksum mismatch .*prepare the data again"):
        loader.verify()
    with pytest.raises(GptforgeError, match="checksum mismatch"):
        loader.next_batch()
