"""`gptforge sample`'s printed text: an infilled middle stands out on a terminal, piped output is the plain text."""

import io

import pytest
import torch

import gptforge.sample
from gptforge.checkpoint import Inference
from gptforge.config import load_config
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.sample import NORMAL, REVERSE, sample_texts
from gptforge.tokens.fim import FIMTokenizer
from gptforge.tokens.tokenizer import load_tokenizer

PREFIX, SUFFIX = "def f(x):\n", "\n    return y\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def fim_run():
    """A random tiny model with the FIM sentinels, as `load_for_inference` gives a FIM checkpoint."""
    tok = FIMTokenizer(load_tokenizer("gpt2"))
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, tie_embeddings=False)
    model = GPT(config).eval()
    return Inference(model, tok, load_config("tiny"), {}, torch.device("cpu"), torch.float32)


def printed(monkeypatch, run, stdout, **kwargs) -> list[str]:
    monkeypatch.setattr(gptforge.sample, "load_for_inference", lambda *args: run)
    monkeypatch.setattr("sys.stdout", stdout)
    return list(sample_texts("ckpt", [PREFIX], max_new_tokens=6, temperature=0.0, **kwargs))


def test_an_infilled_middle_shows_in_reverse_video_on_a_terminal_and_plain_when_piped(monkeypatch, fim_run):
    pieces = printed(monkeypatch, fim_run, Terminal(), suffix=SUFFIX)
    shown = "".join(pieces)
    assert shown.startswith(f"--- sample 0\n{PREFIX}{REVERSE}") and shown.endswith(f"{NORMAL}{SUFFIX}\n")
    middle = [p.removesuffix(f"{SUFFIX}\n") for p in pieces[1:]]
    assert middle and all(p.startswith(REVERSE) and p.endswith(NORMAL) for p in middle if p)  # each piece closes
    plain = "".join(printed(monkeypatch, fim_run, io.StringIO(), suffix=SUFFIX))
    assert shown.replace(REVERSE, "").replace(NORMAL, "") == plain and len(plain) > len(
        f"--- sample 0\n{PREFIX}{SUFFIX}\n"
    )
    assert REVERSE not in "".join(printed(monkeypatch, fim_run, Terminal()))  # a continuation has no middle to mark


def test_the_pieces_add_up_to_the_reply_a_cut_character_waits_and_one_cut_at_the_end_shows(monkeypatch, fim_run):
    tok = fim_run.tokenizer
    byte = {
        b: next(i for i in range(256) if tok.base._enc.decode_single_token_bytes(i) == bytes([b]))
        for b in b"\xc3\xa9\xe2"
    }
    ids = [*tok.encode("x ="), byte[0xC3], byte[0xA9], *tok.encode(" y"), byte[0xE2]]  # é whole, then € cut short
    monkeypatch.setattr(gptforge.sample, "stream", lambda *args, **kwargs: iter(torch.tensor([i]) for i in ids))
    pieces = list(gptforge.sample.reply_pieces(fim_run, [0], (len(ids),)))
    assert "".join(pieces) == "x =é y\ufffd" and pieces[-1] == "\ufffd"  # é's first byte waited for its second
