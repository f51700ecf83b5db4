"""Weight-only int8: each row rounded to 127 steps of its largest magnitude, the model predicting as the float one,
and the engine's compiled step writing what its eager one writes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptforge.model.engine import Decoding, Engine, Sequence
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.quantize import Int8Linear, quantize_int8

MODERN = {"norm": "rmsnorm", "position": "rotary", "qk_norm": True, "bias": False, "mlp": "relu2"}


def tiny(block: dict | None = None) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, vocab_size=64, n_layer=2, n_head=2, n_embd=32, **(block or {})))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.mark.parametrize(("width", "bias"), [(32, True), (32, False), (24, True)])  # 24: not torch's kernel's
def test_an_int8_layer_is_its_rows_rounded_to_127_steps_and_computes_with_them(width, bias):
    torch.manual_seed(0)
    linear = nn.Linear(width, 48, bias=bias)
    layer = Int8Linear(linear.weight, linear.bias)
    w = linear.weight.detach()
    step = w.abs().amax(dim=1) / 127
    assert layer.qweight.dtype == torch.int8 and (layer.qweight.abs().amax(dim=1) == 127).all()
    assert ((layer.qweight.float() * step[:, None] - w).abs() <= step[:, None] / 2 + 1e-7).all()
    assert torch.equal(layer.scale, step.to(torch.bfloat16))

    x = torch.randn(3, 5, width)
    dequantized = layer.qweight.float() * layer.scale.float()[:, None]
    expected = F.linear(x.to(torch.bfloat16).float(), dequantized, linear.bias)
    got = layer(x)
    assert got.shape == (3, 5, 48) and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_a_zero_row_quantizes_to_zeros_not_nan():
    layer = Int8Linear(torch.zeros(4, 8))
    assert torch.equal(layer(torch.ones(2, 8)), torch.zeros(2, 4))


@pytest.mark.parametrize("block", [None, MODERN], ids=["gpt2", "modern"])
def test_an_int8_model_keeps_its_float_embedding_and_predicts_as_the_float_one(block):
    model = tiny(block)
    table = model.transformer.wte.weight.detach().clone()
    idx = torch.randint(0, 64, (4, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(idx, all_logits=True)[0]
        quantize_int8(model)
        after = model(idx, all_logits=True)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear) and torch.equal(model.transformer.wte.weight, table)
    assert (after - before).abs().max() < 0.05 * before.abs().max()
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("step", ["static", "compiled"])
def test_the_int8_static_and_compiled_steps_write_what_the_int8_row_step_writes(step):
    model = quantize_int8(tiny(MODERN))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11] * 4]
    reference = [Sequence(list(p), 10) for p in prompts]
    Engine(model, rows=2).run(*reference)
    again = [Sequence(list(p), 10) for p in prompts]
    Engine(model, rows=2, decode=step).run(*again)
    assert [s.ids for s in again] == [s.ids for s in reference]


@pytest.mark.parametrize(
    ("weights", "step", "message"), [("int4", "rows", "weights='int4'"), ("int8", "fast", "decode='fast'")]
)
def test_an_unknown_decoding_is_refused_naming_what_is_allowed(weights, step, message):
    with pytest.raises(ValueError, match=f"{message}: expected one of "):
        Decoding(weights, step)
