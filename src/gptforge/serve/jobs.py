"""A request as generation sees it: what to do, when to stop, and the events it reports back, in order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gptforge.serve.protocol import ApiError, CompletionRequest
from gptforge.serve.text import Continuation


@dataclass(frozen=True)
class Started:
    """The model is loaded and the prompts fit: the first event of a request that generates."""

    fingerprint: str
    model: str


@dataclass(frozen=True)
class Text:
    index: int
    piece: str


@dataclass(frozen=True)
class Finish:
    index: int
    reason: str
    word: str | None = None  # the stop sequence that ended the choice (reason "stop"), if one did


@dataclass(frozen=True)
class Done:
    usage: dict


@dataclass(frozen=True)
class Failed:
    """Instead of all the others, or after some of them when generation fails midway."""

    error: ApiError


# What the worker reports, in order: Started, then Text and Finish per choice, then Done; or Failed.
Event = Started | Text | Finish | Done | Failed


@dataclass
class Job:
    """One admitted request as its worker sees it: what to do, how to report, when to stop."""

    req: CompletionRequest
    emit: Callable[[Event], None]
    deadline: float  # time.monotonic() past which the text so far ends as "length"
    cancel: threading.Event = field(default_factory=threading.Event)

    def finish_part(self, index: int, text: Continuation, reason: str | None, token: int | None = None) -> None:
        """Report choice `index` after `token` (or its end for `reason`): its new text, then its finish if it ended."""
        piece = text.add(token) if reason is None else text.end(reason)
        if piece:
            self.emit(Text(index, piece))
        if text.finish_reason is not None:
            self.emit(Finish(index, text.finish_reason, text.stop_word))
