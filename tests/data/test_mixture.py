"""Mixtures of data folders: the proportions in every stretch, per-folder epochs, exact resume, rank-disjoint
batches independent of how the stream is batched, and the refusals of a bad `data.mix`."""

import json
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from gptforge.config import load_config
from gptforge.data.loader import TokenLoader
from gptforge.data.mixture import MixtureLoader, Schedule, open_mix, parse_mix
from gptforge.data.shards import write_manifest, write_shard
from gptforge.errors import GptforgeError
from gptforge.tokens.tokenizer import train_bpe

T = 8
OFFSET = 10_000  # folder k's tokens are k * OFFSET + their position: a window tells which folder it came from


def make_folder(path, windows, k, vocab=60_000, eot=0, tokenizer="gpt2"):
    """A prepared folder of `windows` training windows of T tokens (plus one) whose tokens say where they are."""
    path.mkdir(parents=True, exist_ok=True)
    n = windows * T + 1
    sha = write_shard(path / "train_000000.bin", (np.arange(n, dtype=np.uint32) + k * OFFSET) % vocab)
    write_manifest(
        path,
        {
            "tokenizer": {"name": tokenizer, "vocab_size": vocab, "eot": eot},
            "shards": [{"file": "train_000000.bin", "split": "train", "tokens": n, "sha256": sha}],
            "splits": {"train": {"docs": 1, "tokens": n, "bytes": n}},
        },
    )
    return path


def mix(tmp_path, spec):
    """`spec`: (name, windows, weight) per folder -> the sources of `data.mix`."""
    items = [f"{make_folder(tmp_path / name, windows, k)}={weight}" for k, (name, windows, weight) in enumerate(spec)]
    return parse_mix(items)


def origin(x):
    """(folder index, window index) of each row of a batch."""
    return [(int(row[0]) // OFFSET, int(row[0]) % OFFSET // T) for row in x]


@pytest.mark.parametrize(
    "weights",
    [(7, 3), (1, 1), (5, 3, 2), (1, 2, 3, 4), (1, 99), ("1/3", "1/3", "1/3"), (0.45, 0.35, 0.2), (1, 40, 1, 6, 32)],
)
def test_every_prefix_of_the_stream_holds_each_share_rounded(weights):
    shares = [Fraction(str(w)) for w in weights]
    shares = [s / sum(shares) for s in shares]
    schedule, counts = Schedule(shares), [0] * len(shares)
    for n in range(1, 3001):
        counts[schedule.next()] += 1
        for c, share in zip(counts, shares, strict=True):
            assert math.floor(n * share) <= c <= math.ceil(n * share), (n, counts)


def test_the_stream_of_one_mix_is_the_earliest_deadline_first_by_hand(tmp_path):
    # Weights 1:3:4, shares p/8 with p = (1, 3, 4). Window n may come from source i while c_i·8 < (n+1)·p_i; the
    # next window of i is due by ceil((c_i+1)·8 / p_i); the earliest wins, the first source on a tie:
    # n=0 due (8, 3, 2) -> 2 | n=1 (8, 3, -) -> 1 | n=2 (8, 6, 4) -> 2 | n=3 (8, 6, -) -> 1 | n=4 (8, -, 6) -> 2
    # n=5 (8, 8, -) -> 0 | n=6 (-, 8, 8) -> 1 | n=7 (-, -, 8) -> 2, and the same again from n=8.
    # (A floor for the ceiling keeps every prefix rounded but starts with 1: due (8, 2, 2).)
    by_hand = [2, 1, 2, 1, 2, 0, 1, 2] * 2
    sources = mix(tmp_path, [("a", 40, 1), ("b", 40, 3), ("c", 40, 4)])
    loader = MixtureLoader(sources, "train", 4, T, seed=0)
    assert [f for _ in range(4) for f, _ in origin(loader.next_batch()[0])] == by_hand


@pytest.mark.parametrize("weights", [(7, 3), (5, 3, 2), (0.45, 0.35, 0.2), (1, 2, 3, 4)])
def test_every_global_batch_holds_the_weights(tmp_path, weights):
    sources = mix(tmp_path, [(f"s{k}", 400, w) for k, w in enumerate(weights)])
    B, world = 5, 3
    ranks = [MixtureLoader(sources, "train", B, T, rank=r, world_size=world, seed=1) for r in range(world)]
    # Within less than two windows of weight x batch in every global batch (less than one with two folders).
    slack = 1 if len(weights) == 2 else 2
    for _ in range(40):
        rows = [o for loader in ranks for o in origin(loader.next_batch()[0])]
        for k, source in enumerate(sources):
            assert abs(sum(f == k for f, _ in rows) - float(source.share) * B * world) < slack, (k, rows)


def test_the_stream_is_the_same_however_it_is_batched_and_ranks_are_disjoint(tmp_path):
    # 2 ranks x B=2 serve what 1 rank x B=4 serves (as one process with double accumulation must): rank r
    # gets the r-th block of each global batch.
    sources = mix(tmp_path, [("a", 80, 0.6), ("b", 160, 0.4)])
    one = MixtureLoader(sources, "train", 4, T, seed=5)
    two = [MixtureLoader(sources, "train", 2, T, rank=r, world_size=2, seed=5) for r in range(2)]
    for _ in range(10):  # 40 windows: inside the first epoch of both folders, whose ends differ with the batch
        assert torch.equal(one.next_batch()[0], torch.cat([ld.next_batch()[0] for ld in two]))


def test_each_folder_counts_its_own_epochs_and_serves_every_window_once_in_each(tmp_path):
    sources = mix(tmp_path, [("small", 20, 1), ("big", 400, 1)])
    loader = MixtureLoader(sources, "train", 4, T, seed=0)
    seen = {0: [], 1: []}
    for _ in range(25):  # 100 windows: 50 each, i.e. 2.5 epochs of the small folder, 1/8 of the big one's
        for folder, window in origin(loader.next_batch()[0]):
            seen[folder].append(window)
    assert loader.progress(loader.state_dict()) == {"epoch/small": 2.5, "epoch/big": 0.125}
    small = seen[0]
    assert sorted(small[:20]) == sorted(small[20:40]) == list(range(20)) and small[:20] != small[20:40]
    assert len(set(seen[1])) == 50  # the big folder repeats nothing meanwhile


def test_a_one_folder_mix_is_that_folders_token_loader(tmp_path):
    make_folder(tmp_path / "only", 37, 0)  # 37 windows: epochs of 36 over 2 ranks x 3, one window skipped
    sources = parse_mix([f"{tmp_path / 'only'}=0.25"])
    said = MixtureLoader(sources, "train", 3, T, seed=7).describe(800).splitlines()[0]
    assert said == "data: a mix of 1 folder over the planned 800 tokens"
    for rank in range(2):
        mixed = MixtureLoader(sources, "train", 3, T, rank=rank, world_size=2, seed=7)
        plain = TokenLoader(tmp_path / "only", "train", 3, T, rank=rank, world_size=2, seed=7)
        for _ in range(20):  # more than three epochs
            x, y = mixed.next_batch()
            px, py = plain.next_batch()
            assert torch.equal(x, px) and torch.equal(y, py)


def test_resume_continues_the_same_stream_for_every_folder(tmp_path):
    sources = mix(tmp_path, [("a", 12, 3), ("b", 40, 2), ("c", 7, 1)])
    straight = MixtureLoader(sources, "train", 2, T, seed=1)
    expected = [straight.next_batch()[0] for _ in range(60)]  # several epochs of every folder
    first = MixtureLoader(sources, "train", 2, T, seed=1)
    got = [first.next_batch()[0] for _ in range(23)]
    resumed = MixtureLoader(sources, "train", 2, T, seed=999)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next_batch()[0] for _ in range(37)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_new_weights_on_resume_keep_each_folders_position(tmp_path):
    before = mix(tmp_path, [("a", 100, 1), ("b", 100, 1)])
    loader = MixtureLoader(before, "train", 4, T, seed=1)
    for _ in range(5):
        loader.next_batch()
    after = parse_mix([f"{tmp_path / 'a'}=3", f"{tmp_path / 'b'}=1"])
    resumed = MixtureLoader(after, "train", 4, T, seed=1)
    resumed.load_state_dict(loader.state_dict())
    rows = [o for _ in range(10) for o in origin(resumed.next_batch()[0])]
    assert sum(f == 0 for f, _ in rows) == 30  # the new shares hold from the resume on
    assert resumed.progress(resumed.state_dict()) == {"epoch/a": 0.4, "epoch/b": 0.2}  # 10 + 30, 10 + 10


def test_a_second_resume_after_new_weights_continues_the_same_stream(tmp_path):
    # The schedule counts windows since the shares changed, apart from each folder's position: a second resume
    # under the same new shares must read those counts, not the positions, to continue the stream.
    before = mix(tmp_path, [("a", 100, 1), ("b", 100, 1)])
    first = MixtureLoader(before, "train", 4, T, seed=1)
    for _ in range(3):
        first.next_batch()
    after = parse_mix([f"{tmp_path / 'a'}=3", f"{tmp_path / 'b'}=1"])
    straight = MixtureLoader(after, "train", 4, T, seed=1)
    straight.load_state_dict(first.state_dict())
    for _ in range(2):
        straight.next_batch()
    again = MixtureLoader(after, "train", 4, T, seed=1)
    again.load_state_dict(straight.state_dict())
    for _ in range(6):
        assert torch.equal(again.next_batch()[0], straight.next_batch()[0])
    assert again.state_dict() == straight.state_dict()


def test_a_saved_position_of_another_kind_or_shape_is_refused(tmp_path):
    sources = mix(tmp_path, [("a", 100, 1), ("b", 100, 1)])
    state = MixtureLoader(sources, "train", 4, T).state_dict()
    with pytest.raises(GptforgeError, match=f"saved with windows of {T} tokens, now {T // 2}"):
        MixtureLoader(sources, "train", 4, T // 2).load_state_dict(state)
    with pytest.raises(GptforgeError, match=r"saved by a run on a mix \(data.mix\)"):
        TokenLoader(tmp_path / "a", "train", 4, T).load_state_dict(state)
    with pytest.raises(GptforgeError, match=r"saved by a single-folder run \(data.path\)"):
        MixtureLoader(sources, "train", 4, T).load_state_dict(TokenLoader(tmp_path / "a", "train", 4, T).state_dict())


@pytest.mark.parametrize(
    "items,message",
    [
        (["a=0"], r"'a=0' has weight '0' \(expected a positive number written as a decimal such as 0.7, 3 or 2.5e-3"),
        (["a=-1", "b=1"], "'a=-1' has weight '-1'"),
        (["a=lots"], "'a=lots' has weight 'lots'"),
        (["a=nan"], "has weight 'nan'"),
        (["a=1/3", "b=1"], "has weight '1/3'"),
        # An integer of a billion digits to build (it hung), and shares past Python's 4,300-digit str() limit
        (["d1=1e1000000000", "d2=1"], r"'d1=1e1000000000' has weight .* an exponent of at most two digits\)$"),
        (["d1=1e-5000000", "d2=1"], "has weight '1e-5000000'"),
        (["d1=1e-4400", "d2=1"], "has weight '1e-4400'"),
        (["d1=0." + "0" * 30 + "1", "d2=1"], "at most 24 characters"),
        (["a"], r"'a' \(expected FOLDER=WEIGHT"),
        (["=0.5"], "expected FOLDER=WEIGHT"),
        (["data/a=1", "data/./a=2"], "data/a and data/./a are the same folder; list it once"),
        (["x/a=1", "y/a=2"], r"x/a and y/a are both named 'a' \(each folder's metrics are named after it\)"),
    ],
)
def test_a_bad_mix_is_refused_in_one_line_when_the_config_loads(items, message):
    with pytest.raises(GptforgeError, match=message):
        parse_mix(items)
    with pytest.raises(GptforgeError, match=f"^data.mix: .*{message}"):
        load_config("tiny", [f"data.mix={','.join(items)}"])


def test_a_decimal_weight_within_the_bounds_is_exact():
    sources = parse_mix(["a=2.5e-3", "b=.9975", "c=1E+2", "d=99e-99"])
    assert [s.weight for s in sources] == ["2.5e-3", ".9975", "1E+2", "99e-99"]
    total = Fraction(1) + 100 + Fraction(99, 10**99)
    assert [s.share for s in sources] == [Fraction(1, 400) / total, Fraction(399, 400) / total, 100 / total,
                                          Fraction(99, 10**99) / total]  # fmt: skip


def test_the_mix_is_a_toml_list_or_comma_separated_after_set(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('[data]\nmix = ["data/code=0.7", "data/web=0.3"]\n')
    from_toml, from_set = load_config(str(preset)), load_config(overrides=["data.mix=data/code=0.7, data/web=0.3"])
    assert from_toml.data.mix == from_set.data.mix == ["data/code=0.7", "data/web=0.3"]
    assert [(s.name, s.share) for s in parse_mix(from_set.data.mix)] == [
        ("code", Fraction(7, 10)),
        ("web", Fraction(3, 10)),
    ]
    preset.write_text('[data]\nmix = "data/code=0.7"\n')
    with pytest.raises(GptforgeError, match="data.mix: expected a list of strings, got str"):
        load_config(str(preset))
    with pytest.raises(GptforgeError, match="data.mix and data.path .* are exclusive"):
        load_config(overrides=["data.mix=data/code=1", "data.path=data/code"])


def test_a_missing_folder_or_another_tokenizer_is_refused_naming_the_folder(tmp_path):
    a, b = make_folder(tmp_path / "a", 10, 0), make_folder(tmp_path / "b", 10, 1, vocab=50_000)
    with pytest.raises(GptforgeError, match=r"^data.mix: \S*nowhere: no manifest.json"):
        open_mix(parse_mix([f"{a}=1", f"{tmp_path / 'nowhere'}=1"]))
    with pytest.raises(
        GptforgeError, match=rf"^data.mix: {b} was prepared with tokenizer gpt2 \(50,000 tokens, eot 0\), "
    ):
        open_mix(parse_mix([f"{a}=1", f"{b}=1"]))
    c = make_folder(tmp_path / "c", 10, 2, eot=5)
    with pytest.raises(GptforgeError, match=f"{c} was prepared with tokenizer .*eot 5"):
        open_mix(parse_mix([f"{a}=1", f"{c}=1"]))
    tokenizer, manifests = open_mix(parse_mix([f"{a}=1", f"{make_folder(tmp_path / 'd', 10, 3)}=1"]))
    assert tokenizer.name == "gpt2" and len(manifests) == 2


def test_a_mix_of_tokenizers_says_which_tokenizer_to_prepare_again_with(tmp_path):
    gpt2 = make_folder(tmp_path / "gpt2", 10, 0, vocab=50257, eot=50256)
    (tmp_path / "bpe").mkdir()
    bpe = train_bpe(["def f(x):\n    return x\n"] * 5, 300, tmp_path / "bpe" / "tokenizer.json")
    trained = make_folder(tmp_path / "bpe", 10, 0, vocab=bpe.vocab_size, eot=bpe.eot, tokenizer="tokenizer.json")
    fix = f"same tokenizer: prepare {gpt2}'s corpus again with --tokenizer {trained}/tokenizer.json"
    with pytest.raises(GptforgeError, match=re.escape(fix) + "$"):
        open_mix(parse_mix([f"{trained}=1", f"{gpt2}=1"]))
    with pytest.raises(GptforgeError, match=re.escape(f"prepare {trained}'s corpus again with --tokenizer gpt2") + "$"):
        open_mix(parse_mix([f"{gpt2}=1", f"{trained}=1"]))


def test_a_chat_folder_in_a_mix_keeps_its_loss_mask(data_dir, tmp_path):
    from gptforge.data.chat.prepare import ChatSettings, prepare_chat
    from gptforge.data.clean.dedup import DedupSettings

    turns = lambda i: [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]  # noqa: E731
    rows = [json.dumps({"messages": turns(i)}) for i in range(10)]
    (tmp_path / "chats.jsonl").write_text("\n".join(rows) + "\n")
    settings = ChatSettings(val_fraction=0, dedup=DedupSettings(mode="none"))
    prepare_chat(str(tmp_path / "chats.jsonl"), tmp_path / "chat", settings)
    alone = MixtureLoader(parse_mix([f"{tmp_path / 'chat'}=1"]), "train", 2, 16, seed=3)
    plain = TokenLoader(tmp_path / "chat", "train", 2, 16, seed=3)
    for _ in range(6):  # the mix served every token as a target, the user's turns and the padding too
        x, y = alone.next_batch()
        px, py = plain.next_batch()
        assert torch.equal(x, px) and torch.equal(y, py) and (y == -1).any()
    both = MixtureLoader(parse_mix([f"{tmp_path / 'chat'}=1", f"{data_dir}=1"]), "train", 2, 16, seed=3)
    for _ in range(3):  # the stream alternates: a chat window with its mask, a text window whole
        x, y = both.next_batch()
        assert (y[0] == -1).any() and torch.equal(y[1], torch.cat([x[1, 1:], y[1, -1:]]))
