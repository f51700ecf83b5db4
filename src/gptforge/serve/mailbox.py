"""Worker threads' events handed to the event loop in bursts: one wake-up of the loop per burst rather than one per
token of every request (each wake-up is a socket write and a thread switch, which set a small model's pace)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import deque
from typing import Any

# While events keep coming the loop collects them on a timer this often (seconds), not at each post: a stream's
# token a wake-up cost a 5M-parameter model a third of its serve speed on 2 cores, where the loop's thread and the
# client take cores from the decode's threads. A reader does not see 2 ms.
TICK = 0.002


class Mailbox:
    """Events for the queues of one event loop; `post` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: float | None = None) -> None:
        self.loop, self.tick = loop, TICK if tick is None else tick
        self.pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self.lock = threading.Lock()  # guards the two below
        self.waking = False  # a delivery is on its way to the loop
        self.timer: asyncio.TimerHandle | None = None  # the next tick's delivery

    def post(self, queue: asyncio.Queue, *events: Any, urgent: bool = False) -> None:
        """Deliver `events` to `queue` on the loop, in order, after every event posted before them; `urgent` ones
        (a stream's first text, a request's end) at once, not at the next tick."""
        self.pending.extend([(queue, event) for event in events])  # one C call: never cut by a delivery
        with self.lock:
            if self.waking or (self.timer is not None and not urgent):  # a delivery to come will take these too
                return
            self.waking = True
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        with self.lock:
            self.waking = False
        self._flush()

    def _tick(self) -> None:
        with self.lock:
            self.timer = None  # a post from now on wakes the loop, unless this delivery sets another tick
        self._flush()

    def _flush(self) -> None:
        """Hand over what is pending, and look again a tick later; a tick with nothing lets the next post wake the
        loop at once (a quiet server's first event is not held back)."""
        if not self.pending:
            return
        while self.pending:
            queue, event = self.pending.popleft()
            queue.put_nowait(event)
        with self.lock:
            if self.timer is None:
                self.timer = self.loop.call_later(self.tick, self._tick)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (made on the loop's thread, at its first request)."""
    if loop not in _MAILBOXES:
        _MAILBOXES[loop] = Mailbox(loop)
    return _MAILBOXES[loop]
