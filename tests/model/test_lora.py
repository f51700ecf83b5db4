"""LoRA: fresh adapters compute the base model, only adapters train, and merging keeps what they compute."""

import pytest
import torch

from gptforge.model.gpt import GPT, GPTConfig
from gptforge.model.lora import TARGETS, LoRASpec, apply_lora, lora_layers, merge_lora

CFG = GPTConfig(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=32, vocab_multiple=1)


@pytest.fixture
def models():
    torch.manual_seed(0)
    base = GPT(CFG).eval()
    adapted = GPT(CFG).eval()
    adapted.load_state_dict(base.state_dict())
    return base, adapted


def test_fresh_adapters_compute_the_base_model_and_only_they_train(models):
    base, adapted = models
    names = apply_lora(adapted, LoRASpec(rank=4, alpha=8, dropout=0.0, targets=TARGETS))
    assert names == [f"transformer.h.{i}.{t}" for i in range(2) for t in TARGETS]
    idx = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(adapted(idx, all_logits=True)[0], base(idx, all_logits=True)[0], rtol=0, atol=0)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n in names for ab in "AB"}
    assert set(adapted.state_dict()) == set(base.state_dict()) | trainable  # base names unchanged
    assert adapted.transformer.h[0].attn.c_attn.lora_A.shape == (4, 32)  # PEFT's (r, in) and (out, r)
    assert adapted.transformer.h[0].attn.c_attn.lora_B.shape == (96, 4)


def test_only_the_targets_named_are_adapted(models):
    _, adapted = models
    names = apply_lora(adapted, LoRASpec(rank=2, alpha=2, dropout=0.0, targets=("attn.c_attn",)))
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert not any("mlp" in n for n in lora_layers(adapted))


def test_a_trained_adapter_changes_the_output_by_its_scaled_update_and_merges_to_the_same_model(models):
    _, adapted = models
    apply_lora(adapted, LoRASpec(rank=4, alpha=8, dropout=0.1, targets=TARGETS))
    layer = adapted.transformer.h[1].mlp.c_fc
    with torch.no_grad():
        for p in (q for n, q in adapted.named_parameters() if "lora_B" in n):
            p.normal_(0, 0.05)
    x = torch.randn(3, 32)
    expected = x @ layer.weight.T + layer.bias + 2.0 * (x @ layer.lora_A.T @ layer.lora_B.T)  # alpha / r = 2
    torch.testing.assert_close(layer(x), expected)
    idx = torch.randint(0, 97, (2, 16))
    before = adapted(idx, all_logits=True)[0]
    merge_lora(adapted)
    assert not lora_layers(adapted) and not any("lora" in n for n, _ in adapted.named_parameters())
    torch.testing.assert_close(adapted(idx, all_logits=True)[0], before, rtol=1e-5, atol=1e-5)


def test_lora_dropout_drops_the_adapters_input_in_training_and_nothing_in_eval(models):
    _, adapted = models
    apply_lora(adapted, LoRASpec(rank=4, alpha=8, dropout=0.5, targets=TARGETS))
    layer = adapted.transformer.h[0].mlp.c_fc.train()
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.5)
    x = torch.randn(3, 32)
    plain = x @ layer.weight.T + layer.bias
    undropped = plain + 2.0 * (x @ layer.lora_A.T @ layer.lora_B.T)  # alpha / r = 2
    torch.manual_seed(1)
    trained = layer(x)
    torch.manual_seed(1)  # the same draws: the mask dropout applied to x, kept entries scaled by 1 / (1 - p)
    mask = torch.nn.functional.dropout(torch.ones_like(x), p=0.5)
    assert (mask == 0).any() and (mask == 2).any()
    # PEFT's B(A(dropout(x))) * scaling: the frozen layer sees all of x, the adapter the dropped-out x
    torch.testing.assert_close(trained, plain + 2.0 * ((x * mask) @ layer.lora_A.T @ layer.lora_B.T))
    assert not torch.allclose(trained, undropped, atol=1e-3)
    torch.testing.assert_close(layer.eval()(x), undropped)
