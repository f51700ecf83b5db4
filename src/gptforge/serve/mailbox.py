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

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: float = TICK) -> None:
        self.loop, self.tick = loop, tick
        self.pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def post(self, queue: asyncio.Queue, *events: Any) -> None:
        """Deliver `events` to `queue` on the loop, in order, after every event posted before them."""
        self.pending.extend([(queue, event) for event in events])  # one C call: never cut by a delivery
        with self.lock:
            if self.scheduled:  # a delivery is on its way (or the timer's) and will take this event too
                return
            self.scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """Hand over what is pending, then look again a tick later; a tick with nothing lets the next post wake
        the loop at once (a quiet server's first event is not held back)."""
        with self.lock:
            if not self.pending:
                self.scheduled = False  # an event posted from now on schedules another delivery
                return
        while self.pending:
            queue, event = self.pending.popleft()
            queue.put_nowait(event)
        self.loop.call_later(self.tick, self._deliver)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (made on the loop's thread, at its first request)."""
    if loop not in _MAILBOXES:
        _MAILBOXES[loop] = Mailbox(loop)
    return _MAILBOXES[loop]
