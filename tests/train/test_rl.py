"""GRPO from unit tests: the advantage and the loss against hand computations, the loss on reply tokens alone, the
step's tasks, exact resume, and 2 gloo processes taking the step one process takes."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from tests.helpers import chat_checkpoint, weights
from tests.train.test_distributed import free_port

from gptforge.checkpoint import latest_checkpoint
from gptforge.config import load_config
from gptforge.errors import GptforgeError
from gptforge.rundir import read_metrics
from gptforge.tasks.score import Score
from gptforge.train import rl
from gptforge.train.policy import group_advantages, policy_loss, reply_batch
from gptforge.train.rl import task_source, train_rl


def test_advantages_are_rewards_less_their_group_s_mean_scaled_by_its_spread_or_not():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    plain = group_advantages(rewards, scale=False)
    assert torch.allclose(plain, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.75, -0.25, -0.25, -0.25]]))
    scaled = group_advantages(rewards, scale=True)
    spread = 0.75**0.5 * 0.5  # the third group's population standard deviation, sqrt(3) / 4
    expected = [[1.0, -1.0, -1.0, 1.0], [0.0] * 4, [0.75 / spread, -0.25 / spread, -0.25 / spread, -0.25 / spread]]
    assert torch.allclose(scaled, torch.tensor(expected), atol=1e-3)


def test_the_loss_equals_a_hand_computation_clipped_and_with_its_kl():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.5, -0.5], [-0.1, -3.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second reply has two tokens
    adv = torch.tensor([2.0, -1.0])
    parts = policy_loss(logp, old, adv, mask, tokens=5, clip=0.2)
    # Reply 1's ratios: 1, e^0.5 = 1.65 (past 1.2: min(1.65 * 2, 1.2 * 2) = 2.4), 1; reply 2's: 1, 1.
    expected = -(2 * 1 + 2.4 + 2 * 1 + (-1) * 1 + (-1) * 1) / 5
    assert parts.loss.item() == pytest.approx(expected)
    assert parts.clipped == pytest.approx(1 / 5)
    parts.loss.backward()
    # Unclipped tokens: d/dlogp of -A * ratio / 5 = -A * ratio / 5; the clipped one has no gradient.
    assert torch.allclose(logp.grad, torch.tensor([[-0.4, 0.0, -0.4], [0.2, 0.2, 0.0]]))
    ref = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -2.0, -1.0]])
    with_kl = policy_loss(logp.detach(), old, adv, mask, tokens=5, clip=0.2, ref_logp=ref, kl_coef=0.5)
    k3 = torch.exp(torch.tensor(1.0)) - 1.0 - 1.0  # only reply 2's second token differs from ref: log ratio 1
    assert with_kl.loss.item() == pytest.approx(expected + 0.5 * k3.item() / 5)
    assert with_kl.kl == pytest.approx(k3.item() / 5)


def test_the_loss_counts_the_reply_s_tokens_only():
    batch = reply_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], torch.device("cpu"))
    assert batch.idx.tolist() == [[1, 2, 3, 6], [4, 5, 8, 9]]
    assert batch.targets.tolist() == [[2, 3, 6, 7], [5, 8, 9, 10]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    logp = torch.randn(2, 4)
    adv = torch.tensor([1.0, -2.0])
    loss = policy_loss(logp, logp + 0.1, adv, batch.mask, tokens=5, clip=0.2).loss
    changed = logp.clone()
    changed[batch.mask == 0] = -50.0  # the prompt's positions: no bearing on the loss
    assert policy_loss(changed, logp + 0.1, adv, batch.mask, tokens=5, clip=0.2).loss == loss


def test_each_step_has_its_own_tasks_and_a_file_is_taken_whole_each_pass(tmp_path):
    cfg = load_config("rl-cpu", ["rl.tasks_per_step=7"])
    builtin = task_source(cfg)
    assert [t.request for t in builtin(3)] == [t.request for t in builtin(3)]
    assert [t.request for t in builtin(3)] != [t.request for t in builtin(4)]
    assert {t.family for t in builtin(0)} == {
        "reverse", "count_char", "keep_multiples", "clamp", "merge_dicts", "running_sum", "parse_pairs",
    }  # fmt: skip
    rows = [{"request": f"r{i}", "entry_point": "f", "tests": ["assert f() == 1"]} for i in range(5)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_file = task_source(load_config("rl-cpu", [f"rl.tasks={tmp_path / 't.jsonl'}", "rl.tasks_per_step=2"]))
    taken = [t.request for step in range(5) for t in from_file(step)]  # two passes over the 5 tasks
    assert sorted(taken[:5]) == sorted(taken[5:]) == [f"r{i}" for i in range(5)]
    assert taken[:5] != taken[5:]


def test_mined_tasks_come_from_the_corpus_s_training_files(tmp_path):
    doc = 'def {0}(s):\n    """Doubles.\n\n    >>> {0}(2)\n    4\n    """\n    return 2 * s\n'
    for name in ("a", "b"):  # a.py, the first file, is always held out
        (tmp_path / f"{name}.py").write_text(doc.format(f"double_{name}"))
    mined = task_source(load_config("rl-cpu", [f"rl.tasks=doctests:{tmp_path}", "rl.tasks_per_step=1"]))
    assert {t.name for step in range(3) for t in mined(step)} == {"b.py:double_b"}


def fake_scores(tasks, replies, workers=None, timeout=5.0):
    """A reward that a random model earns now and then, from its reply's text alone."""
    return [Score(True, True, sum(map(ord, text)) % 5, 4, True) if text else Score(True, True, 0, 4, True)
            for text in replies]  # fmt: skip


SETTINGS = [
    "rl.tasks_per_step=2", "rl.group=4", "rl.max_new_tokens=6", "rl.reward=share", "rl.eval_tasks=0",
    "rl.micro_batch=3", "optim.lr=0.01", "optim.warmup_steps=0", "train.time_budget=0", "eval.every=0",
    "train.dtype=float32",
]  # fmt: skip


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("rl") / "chat", block_size=128)


def run_rl(out, chat_ckpt, *settings, resume=None):
    cfg = load_config("rl-cpu", [*SETTINGS, f"train.init_from={chat_ckpt}", *settings])
    return train_rl(cfg, out, resume=resume)


def test_a_resumed_run_equals_an_uninterrupted_one(chat_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "score_replies", fake_scores)
    whole = run_rl(tmp_path / "whole", chat_ckpt, "train.max_steps=3", "rl.updates=2", "rl.kl=0.1")
    run_rl(tmp_path / "split", chat_ckpt, "train.max_steps=1", "rl.updates=2", "rl.kl=0.1")
    resumed = run_rl(tmp_path / "split", chat_ckpt, "train.max_steps=3", "rl.updates=2", "rl.kl=0.1", resume="auto")
    assert resumed.steps == whole.steps == 3
    first, second = weights(latest_checkpoint(tmp_path / "whole")), weights(latest_checkpoint(tmp_path / "split"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    start = weights(chat_ckpt)
    assert any(not torch.equal(first[k], start[k]) for k in first)  # it learned something
    rows = [read_metrics(tmp_path / name, ("rl",))["rl"] for name in ("whole", "split")]
    drop = ("time", "sample_s", "score_s", "update_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows[0]] == [
        {k: v for k, v in r.items() if k not in drop} for r in rows[1]
    ]
    assert all(r["kl"] > 0 for r in rows[0][1:])  # the policy moved from the start, which the loss sees
    assert all(r["clipped"] > 0 for r in rows[0])  # the second update's ratio is to the policy that sampled


def _rank(rank, world, port, out, chat_ckpt):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    rl.score_replies = fake_scores
    run_rl(out, chat_ckpt, "train.max_steps=2")


def test_two_gloo_processes_take_the_step_one_process_takes(chat_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(rl, "score_replies", fake_scores)
    run_rl(tmp_path / "one", chat_ckpt, "train.max_steps=2")
    mp.spawn(_rank, args=(2, free_port(), tmp_path / "two", chat_ckpt), nprocs=2)
    one, two = weights(latest_checkpoint(tmp_path / "one")), weights(latest_checkpoint(tmp_path / "two"))
    # Adam turns summation-order noise in a near-zero gradient into a step: a hundredth of the rate is that noise.
    assert all(torch.allclose(one[k], two[k], atol=1e-4) for k in one)
    rows = [read_metrics(tmp_path / name, ("rl",))["rl"] for name in ("one", "two")]
    assert [r["reward"] for r in rows[0]] == pytest.approx([r["reward"] for r in rows[1]])
    assert [r["reply_tokens"] for r in rows[0]] == [r["reply_tokens"] for r in rows[1]]


def test_rl_needs_a_chat_model_to_start_from(tmp_path):
    with pytest.raises(GptforgeError, match="rl needs train.init_from"):
        train_rl(load_config("rl-cpu"), tmp_path / "a")
    base = chat_checkpoint(tmp_path / "base", chat=False, block_size=128)
    with pytest.raises(GptforgeError, match="a base model; rl starts from a chat model"):
        train_rl(load_config("rl-cpu", [f"train.init_from={base}"]), tmp_path / "b")
    with pytest.raises(GptforgeError, match=r"rl.group=1 \(expected in \[2, 1024\]\)"):
        load_config("rl-cpu", ["rl.group=1"])
    rows = [{"request": "word " * 200, "entry_point": "f", "tests": ["assert f() == 1"]}]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = [f"train.init_from={chat_checkpoint(tmp_path / 'chat', block_size=128)}", "rl.tasks_per_step=1"]
    with pytest.raises(GptforgeError, match=r"rl.tasks .*long.jsonl: task .*long.jsonl:1: its request takes"):
        train_rl(load_config("rl-cpu", [*settings, f"rl.tasks={tmp_path / 'long.jsonl'}"]), tmp_path / "c")
    with pytest.raises(GptforgeError, match=r"rl.tasks .*missing.jsonl: cannot read"):
        train_rl(load_config("rl-cpu", [*settings, f"rl.tasks={tmp_path / 'missing.jsonl'}"]), tmp_path / "d")
    assert not any((tmp_path / out).exists() for out in "abcd")  # said before --out is made, let alone logged to


def test_the_rl_command_trains_plots_and_a_second_run_into_the_folder_needs_resume(chat_ckpt, tmp_path, monkeypatch):
    from gptforge.cli import main

    monkeypatch.setattr(rl, "score_replies", fake_scores)
    out = tmp_path / "rl"
    args = ["rl", "--out", str(out), *[a for s in [*SETTINGS, f"train.init_from={chat_ckpt}"] for a in ("--set", s)]]
    assert main([*args, "--set", "train.max_steps=2", "--set", "checkpoint.every=1"]) == 0
    assert (out / "rl.png").is_file() and sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000001", "step_000002",
    ]  # fmt: skip
    assert main(args) == 1  # the folder holds a run: continuing it takes --resume
    assert main([*args, "--set", "train.max_steps=3", "--resume", "auto"]) == 0
    assert latest_checkpoint(out).name == "step_000003"
    assert [r["step"] for r in read_metrics(out, ("rl",))["rl"]] == [1, 2, 3]
    log = (out / "metrics.jsonl").read_text()
    assert main([*args, "--set", "train.max_steps=3", "--resume", "auto"]) == 0  # complete: nothing changes
    assert (out / "metrics.jsonl").read_text() == log and latest_checkpoint(out).name == "step_000003"
