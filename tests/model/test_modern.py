"""The modern block: rotary positions, QK-norm, RMSNorm, gated/squared MLPs, untied and zero-initialised outputs."""

import math

import pytest
import torch

from gptforge.model.generate import generate
from gptforge.model.gpt import GPT, GPTConfig, KVCache, apply_rotary, rotary_tables

MODERN = dict(
    norm="rmsnorm", position="rotary", qk_norm=True, bias=False, tie_embeddings=False, mlp="swiglu", zero_init=True
)


def modern(**changes):
    torch.manual_seed(0)
    fields = {**MODERN, **changes}
    return GPT(GPTConfig(block_size=16, vocab_size=1000, n_layer=2, n_head=2, n_embd=32, **fields))


def test_the_gpt2_preset_keeps_gpt2s_parameters():
    model = GPT(GPTConfig(block_size=16, vocab_size=1000, n_layer=1, n_head=2, n_embd=32))
    assert model.config.is_gpt2 and not modern().config.is_gpt2
    assert sorted(model.state_dict()) == sorted(
        ["lm_head.weight", "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
         "transformer.ln_f.bias"]
        + [f"transformer.h.0.{k}.{p}" for k in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                   "mlp.c_proj") for p in ("weight", "bias")]
    )  # fmt: skip


def test_modern_parameters_have_no_biases_no_position_table_and_an_own_head():
    names = set(modern(zero_init=False).state_dict())
    assert not any(n.endswith(".bias") for n in names) and "transformer.wpe.weight" not in names
    assert {"transformer.h.0.attn.q_norm.weight", "transformer.h.0.attn.k_norm.weight"} <= names
    model = modern(zero_init=False)
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    padding = (1024 - 1000) * 32
    assert model.num_params() == sum(p.numel() for p in model.parameters()) - 2 * padding


def test_zero_init_starts_every_block_as_the_identity_and_predicts_uniformly():
    model = modern()
    idx = torch.randint(0, 1000, (2, 16))
    _, loss = model(idx, idx)
    assert loss.item() == pytest.approx(math.log(1000), abs=1e-6)  # all-zero logits over the real vocabulary
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if n.endswith("c_proj.weight"))


def test_rotary_scores_depend_only_on_the_offset_between_positions():
    cos, sin = rotary_tables(GPTConfig(block_size=64, n_head=1, n_embd=16))
    q, k = torch.randn(16), torch.randn(16)

    def score(m, n):
        return (apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])).item()

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


def hand_rotary(x: torch.Tensor, p: int, base: float) -> torch.Tensor:
    """The half-split rotation of one head's vector x at position p, written out element by element."""
    d, out = x.numel(), x.clone()
    for i in range(d // 2):
        a = p * base ** (-2 * i / d)
        out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
        out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
    return out


def test_rotary_turns_each_half_split_pair_by_position_times_its_frequency():
    model = modern(rope_theta=500.0)
    torch.manual_seed(1)
    q = torch.randn(16, dtype=torch.float64)
    for p in (0, 1, 7, 15):
        got = apply_rotary(q, model.rope_cos[p].double(), model.rope_sin[p].double())
        torch.testing.assert_close(got, hand_rotary(q, p, 500.0), rtol=1e-5, atol=1e-5)


def test_qk_norm_with_its_gains_comes_before_the_rotation():
    """Random per-dimension gains: normalising after rotating would mix gains across each rotated pair."""
    model = modern(zero_init=False)
    attn = model.transformer.h[0].attn
    torch.manual_seed(2)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
    T, hs = 6, 16
    x = torch.randn(1, T, 32)
    y = attn(x, (model.rope_cos[:T], model.rope_sin[:T]))
    q, k, v = attn.c_attn(x)[0].split(32, dim=-1)  # (T, C) each
    heads = []
    for h in range(2):
        cut = slice(h * hs, (h + 1) * hs)

        def normed_then_rotated(z, norm, cut=cut):
            z = torch.nn.functional.rms_norm(z[:, cut], (hs,), norm.weight, norm.eps)
            return torch.stack([hand_rotary(z[t], t, model.config.rope_theta) for t in range(T)])

        qh, kh = normed_then_rotated(q, attn.q_norm), normed_then_rotated(k, attn.k_norm)
        scores = (qh @ kh.T / math.sqrt(hs)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[:, cut])
    torch.testing.assert_close(y[0], attn.c_proj(torch.cat(heads, dim=-1)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mlp", ["swiglu", "relu2"])
def test_cached_generation_equals_a_full_forward_with_rotary_and_qk_norm(mlp):
    model = modern(mlp=mlp, zero_init=False).eval()
    prompt = [5, 17, 300, 2, 999]
    for new in (3, 11, 30):  # within, to and past the block size (the window slides: positions restart)
        assert generate(model, prompt, new, temperature=0, use_cache=True) == generate(
            model, prompt, new, temperature=0, use_cache=False
        )
    idx = torch.randint(0, 1000, (2, 12))
    cache = KVCache(model.config, 2, torch.device("cpu"))
    with torch.no_grad():
        full = model(idx, all_logits=True)[0]
        steps = [model(idx[:, :8], cache=cache)[0][:, -1]]
        steps += [model(idx[:, t : t + 1], cache=cache)[0][:, -1] for t in range(8, 12)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:12], atol=1e-5, rtol=1e-5)


def test_swiglu_keeps_gpt2s_mlp_parameter_count():
    assert GPTConfig(n_embd=768, mlp="swiglu").hidden_size == 2048  # 3 x 768 x 2048 = 2 x 768 x 3072
    assert GPTConfig(n_embd=768, mlp="relu2").hidden_size == 3072
    assert GPTConfig(n_embd=768, mlp="swiglu", mlp_hidden=100).hidden_size == 100


def test_activation_checkpointing_gives_the_same_gradients():
    idx = torch.randint(0, 1000, (2, 16))
    grads = []
    for checkpointing in (False, True):
        model = modern(zero_init=False, activation_checkpointing=checkpointing).train()
        model(idx, idx)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_an_unknown_component_is_refused():
    with pytest.raises(ValueError, match="model.mlp='geglu': expected one of gelu, swiglu, relu2"):
        modern(mlp="geglu")
