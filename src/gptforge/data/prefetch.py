"""Batches read ahead on a background thread, so disk reads and page-locking overlap the model's compute.

Each batch carries the loader state after it was drawn; `state_dict()` is the state of the last batch handed
out, so a checkpoint resumes at the first batch the model has not seen, however far the thread has read ahead.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from gptforge.data.loader import TokenLoader
from gptforge.data.mixture import MixtureLoader


class Prefetcher:
    def __init__(self, loader: TokenLoader | MixtureLoader, depth: int = 4, pin_memory: bool = False) -> None:
        self.loader, self.pin_memory = loader, pin_memory
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="gptforge-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                x, y = self.loader.next_batch()
                if self.pin_memory:  # page-locked memory lets the host-to-GPU copy run asynchronously
                    x, y = x.pin_memory(), y.pin_memory()
                self._put((x, y, self.loader.state_dict()))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._put(e)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        x, y, self._state = item
        return x, y

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
