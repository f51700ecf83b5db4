import math

import torch

from gptforge.model import GPT, MODEL_PRESETS, GPTConfig


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{"block_size": 16, "vocab_size": 1000, "n_layer": 2, "n_head": 2, "n_embd": 32, **kw})


def test_initial_loss_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(tiny())
    x = torch.randint(0, 1000, (8, 16))
    _, loss = model(x, torch.randint(0, 1000, (8, 16)))
    assert abs(loss.item() - math.log(1000)) < 0.1


def test_gpt2_124m_parameter_count_and_padding():
    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL_PRESETS["gpt2"]))
    assert model.config.padded_vocab_size == 50304
    assert model.num_params() == 124_439_808
    assert model.lm_head.weight is model.transformer.wte.weight


def test_padded_vocabulary_is_never_scored():
    model = GPT(tiny(vocab_size=1000, vocab_multiple=128))
    assert model.transformer.wte.weight.shape[0] == 1024
    logits, _ = model(torch.randint(0, 1000, (2, 16)))
    assert logits.shape[-1] == 1000


def test_causality():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x = torch.randint(0, 1000, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 1000
    lx, _ = model(x, x)
    ly, _ = model(y, y)
    torch.testing.assert_close(lx[0, :10], ly[0, :10])
    assert not torch.allclose(lx[0, 10:], ly[0, 10:])


def test_residual_projection_init_is_scaled():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=8, n_embd=256, n_head=4))
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001
