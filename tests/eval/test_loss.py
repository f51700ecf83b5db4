"""Validation loss and bits per byte against a known answer; which windows an evaluation scores."""

import math

import pytest
import torch

from gptforge.data.loader import TokenLoader
from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings
from gptforge.eval.loss import evaluate_loss, evaluated_tokens
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer

DOC = "déjà vu: naïve café ☕ — 日本語のテキスト, Ünïcödé everywhere.\n"


def test_all_zero_logits_give_ln_v_and_the_exact_bits_per_byte(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # identical documents: every split has the same tokens-per-byte ratio
        (corpus / f"doc_{i:02d}.txt").write_text(DOC * 3, encoding="utf-8")
    settings = PrepareSettings.from_flags(str(corpus), val_fraction=0.25, dedup="none")  # copies kept on purpose
    prepare(settings, tmp_path / "data", workers=1)
    tok = load_tokenizer("gpt2")
    tokens_per_doc = len(tok.encode(DOC * 3)) + 1  # each document ends with EOT
    bytes_per_doc = len((DOC * 3).encode("utf-8"))

    model = GPT(GPTConfig(block_size=16, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied to wte: every logit is 0, the uniform distribution
    result = evaluate_loss(model, tmp_path / "data", 2, 16, 10_000, torch.device("cpu"), torch.float32)
    V = tok.vocab_size
    assert result["loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert result["ppl"] == pytest.approx(V, rel=1e-5)
    assert result["bpb"] == pytest.approx(math.log(V) / math.log(2) * tokens_per_doc / bytes_per_doc, rel=1e-6)


def test_the_batch_size_changes_how_windows_are_batched_not_which_are_scored(data_dir):
    """Training evaluates in its micro-batches, `gptforge eval` in its --batch-size: the same tokens either way."""
    model = GPT(GPTConfig(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=16))
    cpu = torch.device("cpu")
    results = [evaluate_loss(model, data_dir, b, 32, 5 * 32, cpu, torch.float32) for b in (2, 3, 8)]
    assert [r["tokens"] for r in results] == [5 * 32] * 3  # 5 windows: not a whole number of batches of 2, 3 or 8
    assert all(r["loss"] == pytest.approx(results[0]["loss"], abs=1e-5) for r in results)
    loader = TokenLoader(data_dir, "val", 4, 32, shuffle=False)
    assert evaluated_tokens(loader, 5 * 32) == 5 * 32 and evaluated_tokens(loader, 10**9) == loader.n_windows * 32
