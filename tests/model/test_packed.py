"""Packed documents: each computes what it computes alone, and the loss counts only the targets kept."""

import pytest
import torch
import torch.nn.functional as F

from gptforge.model.gpt import GPT, GPTConfig, document_mask, explicit_causal_attention

TINY = dict(block_size=32, vocab_size=61, n_layer=2, n_head=2, n_embd=16, vocab_multiple=8)


def test_positions_restart_and_attention_stays_inside_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    positions, allowed = document_mask(docs)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert allowed.shape == (1, 1, 6, 6)
    assert allowed[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert allowed[0, 0, 2].tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize(
    "arch",
    [dict(), dict(position="rotary", norm="rmsnorm", qk_norm=True, bias=False, mlp="relu2", tie_embeddings=False)],
    ids=["gpt2", "modern"],
)
def test_each_packed_document_gives_the_logits_it_gives_alone(arch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **arch)).eval()
    a, b = torch.randint(0, 61, (1, 7)), torch.randint(0, 61, (1, 9))
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 7 + [1] * 9])
    logits, _ = model(packed, all_logits=True, docs=docs)
    alone = torch.cat([model(a, all_logits=True)[0], model(b, all_logits=True)[0]], dim=1)
    torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)


def test_the_gpu_s_masked_sdpa_computes_what_the_cpu_s_explicit_attention_does():
    q, k, v = torch.randn(3, 2, 2, 10, 8).unbind(0)
    _, allowed = document_mask(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 10]))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(explicit_causal_attention(q, k, v, 0.0, allowed), sdpa, rtol=1e-5, atol=1e-5)


def test_the_loss_is_the_mean_over_the_targets_kept_and_zero_when_none_are():
    torch.manual_seed(0)
    for fused in (True, False):
        model = GPT(GPTConfig(**TINY, fused_loss=fused))
        idx, targets = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
        targets[0, :5] = -1
        targets[1, 8:] = -1
        docs = torch.zeros_like(idx)
        logits, loss = model(idx, targets, all_logits=True, docs=docs)
        keep = targets >= 0
        expected = F.cross_entropy(logits[keep].float(), targets[keep])
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        _, zero = model(idx, torch.full_like(targets, -1), docs=docs)
        zero.backward()
        assert zero.item() == 0.0 and all(p.grad is not None for p in model.parameters())


def test_a_model_with_a_document_token_packs_its_training_rows_by_it():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, document_token=60)).eval()
    idx = torch.tensor([[5, 6, 7, 60, 8, 9, 60, 10]])
    targets = torch.tensor([[-1, 7, 60, -1, 9, 60, -1, 11]])
    _, loss = model(idx, targets)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]])
    logits, expected = model(idx, targets, all_logits=True, docs=docs)
    torch.testing.assert_close(loss, expected)
    alone = model(torch.tensor([[8, 9, 60]]), all_logits=True)[0]
    torch.testing.assert_close(logits[:, 4:7], alone, rtol=1e-5, atol=1e-5)
    generated = model(idx)[0]  # no targets: inference reads the row as one text
    torch.testing.assert_close(generated, model(idx, all_logits=True)[0][:, -1:])
