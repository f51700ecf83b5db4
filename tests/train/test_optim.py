import math

import pytest

from gptforge.config import OptimConfig
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.train.optim import build_optimizer, cosine_lr, lr_at


def test_schedule_values():
    lr = lambda s: cosine_lr(s, max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=110)  # noqa: E731
    assert lr(0) == pytest.approx(6e-5)  # warm-up starts at max_lr / warmup
    assert lr(9) == pytest.approx(6e-4)  # and ends at max_lr
    assert lr(10) == pytest.approx(6e-4)
    assert lr(60) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))  # halfway through the cosine
    assert lr(35) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi / 4)) * (6e-4 - 6e-5))
    assert lr(110) == pytest.approx(6e-5)
    assert lr(500) == pytest.approx(6e-5)


def test_weight_decay_only_on_matrices():
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=1, n_embd=8))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())  # the tied embedding appears once


def test_wsd_and_constant_schedules():
    wsd = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lr_at(0, wsd, 100) == pytest.approx(0.1)
    assert lr_at(50, wsd, 100) == 1.0 and lr_at(79, wsd, 100) == 1.0
    assert lr_at(90, wsd, 100) == pytest.approx(0.55)
    assert lr_at(100, wsd, 100) == pytest.approx(0.1)
    const = OptimConfig(lr=2.0, warmup_steps=4, schedule="constant")
    assert [lr_at(s, const, 100) for s in (0, 3, 50)] == [0.5, 2.0, 2.0]
    with pytest.raises(GptforgeError, match="optim.schedule='linear'"):
        lr_at(0, OptimConfig(schedule="linear"), 10)
