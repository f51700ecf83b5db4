"""Fill-in-the-middle's tokens: the three sentinels, appended just past a tokenizer's vocabulary (for GPT-2's
50257: 50257-50259, inside the padded embedding, so the model's shape does not change), and an infill's prompt."""

from __future__ import annotations

from dataclasses import dataclass

from gptforge.tokens.tokenizer import ExtendedTokenizer, Tokenizer

FIM_TEXTS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")


@dataclass(frozen=True)
class Sentinels:
    prefix: int
    middle: int
    suffix: int


class FIMTokenizer(ExtendedTokenizer):
    """A tokenizer with the FIM sentinels appended past its vocabulary."""

    def __init__(self, base: Tokenizer) -> None:
        super().__init__(base, FIM_TEXTS)
        self.sentinels = Sentinels(*range(base.vocab_size, base.vocab_size + 3))


def with_fim(tokenizer: Tokenizer, fim_rate: float) -> Tokenizer:
    """The tokenizer a run with `data.fim_rate` trains with: the sentinels appended when FIM is on."""
    return FIMTokenizer(tokenizer) if fim_rate > 0 and not isinstance(tokenizer, FIMTokenizer) else tokenizer


def end_ids(tokenizer: Tokenizer) -> set[int]:
    """Tokens that end a generated text: EOT, a FIM model's sentinels (an infilled middle ends there too), and a
    chat model's end of turn (its `stop_ids`)."""
    sentinels = getattr(tokenizer, "sentinels", None)
    return {tokenizer.eot, *(vars(sentinels).values() if sentinels else ()), *getattr(tokenizer, "stop_ids", ())}


def infill_prompt(tokenizer: FIMTokenizer, prefix: str, suffix: str) -> list[int]:
    """The PSM prompt whose continuation is the middle: prefix, suffix, then the middle sentinel."""
    s = tokenizer.sentinels
    return [s.prefix, *tokenizer.encode(prefix), s.suffix, *tokenizer.encode(suffix), s.middle]
