import math

import pytest
import torch

from gptforge.config import OptimConfig, load_config
from gptforge.errors import GptforgeError
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.train.muon import Muon
from gptforge.train.optim import build_optimizer, lr_at, set_lr


def test_schedule_values():
    cosine = OptimConfig(lr=6e-4, min_lr_ratio=0.1, warmup_steps=10, schedule="cosine")
    lr = lambda s: lr_at(s, cosine, 110)  # noqa: E731
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


def modern_model():
    cfg = GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=1, n_embd=8, tie_embeddings=False, bias=False)
    return GPT(cfg)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = modern_model()
    opt = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1), "cpu")
    assert isinstance(opt.muon, Muon) and isinstance(opt.adamw, torch.optim.AdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon}
    assert names == {f"transformer.h.{i}.{m}.weight" for i in (0, 1) for m in ("attn.c_attn", "attn.c_proj",
                                                                              "mlp.c_fc", "mlp.c_proj")}  # fmt: skip
    decay, no_decay = opt.adamw.param_groups
    tables = (model.transformer.wte, model.transformer.wpe, model.lm_head)
    assert {id(p) for p in decay["params"]} == {id(m.weight) for m in tables}
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert set_lr(opt, 5e-4) == 5e-4  # the schedule's value is AdamW's; Muon's keeps its 20x
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.01), 5e-4, 5e-4]


def test_muon_resumes_from_its_state_dict():
    model = modern_model()
    cfg = OptimConfig(optimizer="muon")
    opt = build_optimizer(model, cfg, "cpu")
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))[1].backward()
    opt.step()
    again = build_optimizer(model, cfg, "cpu")
    again.load_state_dict(opt.state_dict())
    assert again.state_dict()["muon"]["state"].keys() == opt.state_dict()["muon"]["state"].keys() != set()
    with pytest.raises(ValueError, match="Muon \\+ AdamW state"):
        again.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_muon_is_refused_with_zero_in_one_line():
    with pytest.raises(GptforgeError, match="optim.optimizer=muon with train.zero=true: ZeRO shards"):
        load_config("tiny", ["optim.optimizer=muon", "train.zero=true"])  # one process too


DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def muon_steps(make, shapes=((2304, 768), (96, 32), (32, 32), (32, 128), (128, 32), (96, 32)), steps=2, group=None):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.1) for shape in shapes]
    opt = make(params)
    for g in opt.param_groups:
        g.update(group or {})
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params


def test_muon_is_torchs_in_bf16_and_orthogonalises_in_fp32_when_asked():
    """Batched by shape (a lone tall GPT-2 matrix too), ours in bf16 is torch.optim.Muon bitwise, with its group
    settings; in fp32 it is within 1e-6 of fp64 (6e-8 measured), torch's bf16 over 1e-4."""
    ours = {dtype: muon_steps(lambda ps, d=dtype: Muon(ps, 0.02, 0.1, 0.95, d)) for dtype in DTYPES}
    fp64 = ours[torch.float64]
    error = {d: max((a - b).abs().max().item() for a, b in zip(ps, fp64, strict=True)) for d, ps in ours.items()}
    assert error[torch.float32] < 1e-6 < 1e-4 < error[torch.bfloat16]
    if hasattr(torch.optim, "Muon"):  # torch >= 2.9
        torchs = lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)  # noqa: E731
        theirs = muon_steps(torchs)
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours[torch.bfloat16], strict=True))
        other = {"adjust_lr_fn": "match_rms_adamw", "ns_coefficients": (3.0, -3.2, 1.2), "ns_steps": 4}
        ours_other = muon_steps(lambda ps: Muon(ps, 0.02, 0.1, 0.95, torch.bfloat16), group=other)
        assert all(torch.equal(a, b) for a, b in zip(muon_steps(torchs, group=other), ours_other, strict=True))
        assert (
            torch.optim.Muon(theirs, lr=0.02).param_groups[0].keys()
            == Muon(theirs, 0.02, 0, 0.95, DTYPES[0]).param_groups[0].keys()
        )
    precision = {
        d: build_optimizer(modern_model(), OptimConfig(optimizer="muon"), "cpu", dtype=d).muon.dtype for d in DTYPES
    }
    assert precision == {torch.bfloat16: torch.bfloat16, torch.float32: torch.float32, torch.float64: torch.float32}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_with_lora_the_optimizer_holds_and_steps_the_adapters_alone_without_decay(optimizer):
    from gptforge.model.lora import TARGETS, LoRASpec, apply_lora

    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    apply_lora(model, LoRASpec(rank=2, alpha=4, dropout=0.0, targets=TARGETS))
    opt = build_optimizer(model, OptimConfig(optimizer=optimizer, weight_decay=0.1), "cpu")
    adapters = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == adapters and len(held) == 16
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups if g["params"])
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))[1].backward()
    opt.step()
    assert {
        id(p) for p in opt.state
    } == adapters  # a plain AdamW: Muon has no matrix left to train  # optimizer state for the adapters alone
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if ".lora_" not in n)
