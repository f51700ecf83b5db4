"""One completion's text as its tokens arrive: what is safe to send now, and where a stop sequence ends it."""

from __future__ import annotations

from gptforge.tokens.text_stream import TextStream
from gptforge.tokens.tokenizer import Tokenizer


class Continuation:
    """Decodes the tokens so far; holds back a multi-byte character's first bytes and any tail that could be
    the start of a stop sequence, so streamed pieces always add up to the final text."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.stop = stop
        self.decoded = TextStream(tokenizer)
        self.text = ""
        self.sent = 0  # characters of self.text already handed out
        self.finish_reason: str | None = None
        self.stop_word: str | None = None  # the stop sequence that ended it, if one did

    @property
    def ids(self) -> list[int]:
        return self.decoded.ids

    def add(self, token: int) -> str:
        """The text to send after `token`; sets finish_reason 'stop' when a stop sequence appears."""
        if not self.decoded.add(token):  # the rest of a multi-byte character is still to come
            return ""
        return self._upto(self.decoded.text, final=False)

    def end(self, reason: str) -> str:
        """The rest of the text (a cut multi-byte character included), ending with `reason`; or at a stop sequence
        that the rest completes ('stop')."""
        if self.finish_reason is not None:
            return self._release(len(self.text))
        piece = self._upto(self.decoded.whole(), final=True)
        self.finish_reason = self.finish_reason or reason
        return piece

    def _upto(self, text: str, final: bool) -> str:
        """Take `text` as the text so far: cut at the first stop sequence in it, else held back by any tail that
        could start one (unless `final`); the part not sent yet."""
        found = [(i, s) for i, s in ((text.find(s, self.sent), s) for s in self.stop) if i >= 0]
        if found:
            cut, self.stop_word = min(found)
            self.text, self.finish_reason = text[:cut], "stop"
            return self._release(cut)
        self.text = text
        return self._release(len(text) if final else len(text) - self._held(text))

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop sequence starts with."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: int) -> str:
        piece = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return piece
