import dataclasses
import math

import torch
import torch.nn.functional as F

from gptforge.model.gpt import GPT, MODEL_PRESETS, GPTConfig, explicit_causal_attention


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


def test_num_weights_counts_every_parameter_of_every_block_without_building_it():
    import itertools

    choices = itertools.product(("layernorm", "rmsnorm"), ("learned", "rotary"), (False, True), ("gelu", "swiglu"))
    for norm, position, flag, mlp in choices:
        cfg = dataclasses.replace(
            tiny(), norm=norm, position=position, qk_norm=flag, bias=flag, tie_embeddings=not flag, mlp=mlp
        )
        assert cfg.num_weights == sum(p.numel() for p in GPT(cfg).parameters()), cfg


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
    lx, _ = model(x, all_logits=True)
    ly, _ = model(y, all_logits=True)
    torch.testing.assert_close(lx[0, :10], ly[0, :10])
    assert not torch.allclose(lx[0, 10:], ly[0, 10:])


def test_residual_projection_init_is_scaled():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=8, n_embd=256, n_head=4))
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001


def _rebuilt(model, **options):
    """The same weights in a model built from a config with `options` changed."""
    other = GPT(dataclasses.replace(model.config, **options))
    other.load_state_dict(model.state_dict())
    return other


def _loss_and_grads(model, x, y, fused, dtype=torch.float32):
    model = _rebuilt(model, fused_loss=fused)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits, loss = model(x, y)
    loss.backward()
    assert logits is None or not fused  # the fused path never builds the logits
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fused_loss_equals_plain_cross_entropy_and_its_gradients():
    """Chunked lm_head + cross-entropy gives the plain path's loss and every parameter's gradient."""
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=1000, vocab_multiple=128))
    x, y = torch.randint(0, 1000, (4, 16)), torch.randint(0, 1000, (4, 16))
    plain_loss, plain = _loss_and_grads(model, x, y, fused=False)
    fused_loss, fused = _loss_and_grads(model, x, y, fused=True)
    assert abs(plain_loss - fused_loss) < 1e-5
    for name in plain:
        torch.testing.assert_close(fused[name], plain[name], atol=1e-6, rtol=1e-4)
    assert fused["transformer.wte.weight"][1000:].abs().max() == 0  # padded rows get no gradient
    with torch.no_grad():
        assert abs(model(x, y)[1].item() - plain_loss) < 1e-5


def test_fused_loss_under_bf16_autocast_stays_within_bf16_of_plain():
    torch.manual_seed(0)
    model = GPT(tiny())
    x, y = torch.randint(0, 1000, (4, 16)), torch.randint(0, 1000, (4, 16))
    plain_loss, plain = _loss_and_grads(model, x, y, fused=False, dtype=torch.bfloat16)
    fused_loss, fused = _loss_and_grads(model, x, y, fused=True, dtype=torch.bfloat16)
    assert abs(plain_loss - fused_loss) < 0.01 * plain_loss
    g_plain, g_fused = plain["transformer.wte.weight"], fused["transformer.wte.weight"]
    assert (g_fused - g_plain).norm() < 0.02 * g_plain.norm()


def test_explicit_cpu_attention_equals_sdpa_and_its_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8, requires_grad=True) for _ in range(3))
    ours = explicit_causal_attention(q, k, v, 0.0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, ref)
    g = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g))


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=3, n_head=2, n_embd=16))
    x = torch.randint(0, 100, (2, 16))
    grads = []
    for flag in (False, True):
        rebuilt = _rebuilt(model, activation_checkpointing=flag)
        rebuilt(x, x)[1].backward()
        grads.append([p.grad.clone() for p in rebuilt.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)
