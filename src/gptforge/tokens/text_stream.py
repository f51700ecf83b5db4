"""A reply's text as its tokens arrive, decoded incrementally."""

from __future__ import annotations

from gptforge.tokens.tokenizer import Tokenizer


class TextStream:
    """Decodes only the tokens since the text last ended on a whole character: byte-level BPE's text is the
    concatenation of its pieces' there. Decoding the whole reply at every token made a 1,000-token stream
    quadratic (114 us a token at its end, half the demo model's decode step)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # the text of ids[: self._whole]
        self._whole = 0

    def add(self, token: int) -> bool:
        """Take `token`; True when the text now ends on a whole character (else `text` waits for the rest)."""
        self.ids.append(token)
        tail = self.tokenizer.decode(self.ids[self._whole :])
        if tail.endswith("\ufffd"):  # the rest of a multi-byte character is still to come
            return False
        self.text += tail
        self._whole = len(self.ids)
        return True

    def whole(self) -> str:
        """All the text, a multi-byte character cut short at the end included (as a replacement character)."""
        return self.text + self.tokenizer.decode(self.ids[self._whole :])
