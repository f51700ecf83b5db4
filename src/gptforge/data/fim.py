"""Fill-in-the-middle training (Bavarian et al. 2022, "FIM for free"): as training windows are read, each document
in them is, with probability `data.fim_rate`, cut at two character positions into prefix, middle and suffix and
rearranged so that the middle comes last, after sentinel tokens:

    PSM: <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle
    SPM: <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle      (StarCoder's form, `fim_spm_rate`)

The sentinels take the three ids just past the tokenizer's vocabulary (for GPT-2's 50257: 50257-50259, inside the
padded embedding, so the model's shape does not change). A window keeps its length: the suffix gives up the tokens
the sentinels add; a document too short for that stays as it was. The cut points come from a generator seeded by
(seed, epoch, window), so resume stays exact and any number of processes read the same windows alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gptforge.tokens.fim import FIM_TEXTS, FIMTokenizer

FIM_STREAM = 0xF1F  # keeps FIM's random numbers apart from the window order's, which shares the seed


@dataclass
class FIM:
    """The transformation a training loader applies to its windows."""

    tokenizer: FIMTokenizer
    rate: float
    spm_rate: float

    def window(self, tokens: np.ndarray, key: tuple[int, ...]) -> np.ndarray:
        """`tokens` (int64) with each EOT-delimited document rearranged with probability `rate`; same length,
        the same result for the same `key`."""
        rng = np.random.default_rng([FIM_STREAM, *key])
        ends = [*np.flatnonzero(tokens == self.tokenizer.eot).tolist(), len(tokens)]
        pieces, start = [], 0
        for end in ends:
            pieces += [self.document(tokens[start:end], rng.random(4)), tokens[end : end + 1]]
            start = end + 1
        return np.concatenate(pieces)

    def document(self, tokens: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """One document's tokens, rearranged if `draws[0]` < rate (PSM, or SPM if `draws[1]` < spm_rate) with cut
        points at fractions `draws[2:]` of its characters."""
        if draws[0] >= self.rate or len(tokens) == 0:
            return tokens
        text = self.tokenizer.decode(tokens)
        i, j = sorted(int(d * (len(text) + 1)) for d in draws[2:])
        prefix, middle, suffix = (self.tokenizer.encode(t) for t in (text[:i], text[i:j], text[j:]))
        excess = len(prefix) + len(middle) + len(suffix) + len(FIM_TEXTS) - len(tokens)
        if not 0 <= excess <= len(suffix):
            return tokens
        suffix = suffix[: len(suffix) - excess]
        s = self.tokenizer.sentinels
        if draws[1] < self.spm_rate:
            out = [s.prefix, s.suffix, *suffix, s.middle, *prefix, *middle]
        else:
            out = [s.prefix, *prefix, s.suffix, *suffix, s.middle, *middle]
        return np.asarray(out, dtype=tokens.dtype)
