"""A reply decoded token by token is the reply decoded whole, at every point where its text ends on a character."""

import random

import pytest

from gptforge.tokens.chat import with_chat
from gptforge.tokens.text_stream import TextStream
from gptforge.tokens.tokenizer import load_tokenizer


@pytest.mark.parametrize("chat", [False, True])
def test_the_stream_is_the_whole_decode_whatever_bytes_and_special_tokens_come(chat):
    tok = with_chat(load_tokenizer("gpt2")) if chat else load_tokenizer("gpt2")
    rng, whole_at = random.Random(0), 0
    # GPT-2's first 256 ids are single bytes: runs of them cut, complete and break multi-byte characters.
    pool = [*range(256), *range(256, tok.vocab_size, 97), *range(50257, tok.vocab_size)]
    for _ in range(200):
        stream, ids = TextStream(tok), []
        for _ in range(rng.randrange(1, 40)):
            ids.append(rng.choice(pool) if rng.random() < 0.5 else rng.randrange(256))
            full = tok.decode(ids)
            if stream.add(ids[-1]):
                assert stream.text == full
                whole_at += 1
            else:
                assert full.endswith("\ufffd") and full.startswith(stream.text)
            assert stream.whole() == full
        assert stream.ids == ids
    assert whole_at > 1000  # texts ended on whole characters often: the check above ran
