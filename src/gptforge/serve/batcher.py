"""Continuous batching: the choices of every admitted request decode together, one token a step, joining and
leaving the batch at token boundaries, each with its own sampling settings, stop sequences, seed and KV cache row."""

from __future__ import annotations

import functools
import secrets
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from gptforge.checkpoint import Inference
from gptforge.errors import GptforgeError
from gptforge.model.engine import Engine, Sequence
from gptforge.model.sampling import Sampling
from gptforge.serve.jobs import Done, Event, Failed, Job, Started, Text
from gptforge.serve.protocol import ApiError
from gptforge.serve.text import Continuation
from gptforge.tokens.fim import end_ids

T = TypeVar("T")


@dataclass
class Task:
    """One request in the batcher: its choices still to end; `end` is told how it ended."""

    job: Job
    run: Inference
    started: Started
    end: Callable[[Event | None], None]  # told how it ended, once, from the batcher's thread
    prompt_tokens: int
    unfinished: int
    began: bool = False
    completion_tokens: int = 0
    ended: threading.Event = field(default_factory=threading.Event)
    choices: list[Choice] = field(default_factory=list)


@dataclass(eq=False)
class Choice:
    """One completion of one prompt: the engine's sequence for it and its text so far."""

    task: Task
    index: int
    text: Continuation
    seq: Sequence = field(init=False)


class Batcher:
    """Hands up to `capacity` choices at a time to the engine of their model (requests for another wait their turn:
    the engine switches when it empties); the rest wait in arrival order. Deadlines, cancellation and the events
    a request reports are kept here; decoding is the engine's."""

    def __init__(self, capacity: int, stopping: threading.Event) -> None:
        self.capacity, self.stopping = capacity, stopping
        self._cond = threading.Condition()
        self._waiting: deque[Choice] = deque()
        self._run: Inference | None = None  # the model the engine decodes
        self._engine: Engine | None = None
        self._in: dict[Sequence, Choice] = {}  # the choices handed to the engine
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._thread: threading.Thread | None = None

    @property
    def generating(self) -> int:
        return len(self._in)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, daemon=True, name="gptforge-batcher")
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the batcher's thread between two steps (inline before `start`): a model's torch work
        all on one thread, as OpenMP threads started by a second one (a model's load) made every later decode
        step 2-4x slower on a 2-core host."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify()
        return future.result()

    def submit(
        self, job: Job, run: Inference, prompts: list[list[int]], started: Started, end: Callable[[Event | None], None]
    ) -> Task:
        """Queue every choice of `job` (n per prompt); `end` is told its last event."""
        req = job.req
        seed = secrets.randbits(63) if req.seed is None else req.seed % 2**63
        seeds = torch.randint(2**62, (len(prompts) * req.n,), generator=torch.Generator().manual_seed(seed))
        task = Task(job, run, started, end, sum(map(len, prompts)), len(seeds))
        ends = frozenset(end_ids(run.tokenizer))
        # Past the context the window would slide past an infill's sentinels or the template's opening of a chat.
        slides = req.suffix is None and req.messages is None
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                choice = Choice(task, index=p * req.n + j, text=Continuation(run.tokenizer, req.stop))
                choice.seq = Sequence(
                    list(ids),
                    req.max_tokens,
                    Sampling(req.temperature, req.top_k, req.top_p),
                    torch.Generator(device=run.device).manual_seed(int(seeds[p * req.n + j])),
                    ends,
                    slides=slides,
                    prompt_key=(id(task), p),  # the prompt is prefilled once for its n choices
                    watch=functools.partial(self._take, choice),
                    ended=functools.partial(self._left, choice),
                )
                task.choices.append(choice)
        with self._cond:
            self._waiting.extend(task.choices)
            self._cond.notify()
        return task

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._calls or self._waiting or self.generating)
                calls, self._calls = self._calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the caller's to raise, on its own thread
                    future.set_exception(e)
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        """Let in the choices that fit, then the engine takes one token for every choice it holds."""
        entering: list[Choice] = []
        try:
            entering = self._admit()
            for choice in entering:
                self._enter(choice)
            self._expire()
            if self._engine is not None and self._engine.busy:
                self._engine.step()
        except GptforgeError as e:  # the model has diverged: the server is fine, this model is not
            self._fail_all(entering, ApiError(503, str(e), None, "model_unavailable"))
        except Exception:  # noqa: BLE001 - a bug fails the requests in the batch, not the server
            traceback.print_exc()
            self._fail_all(entering, ApiError(500, "internal error in gptforge serve (its log has the traceback)"))

    def _fail_all(self, entering: list[Choice], error: ApiError) -> None:
        """Fail every request with a choice in the engine; the next batch starts afresh."""
        tasks = {id(c.task): c.task for c in [*entering, *self._in.values()]}
        self._in, self._run, self._engine = {}, None, None
        for task in tasks.values():
            self._fail(task, error)

    def _admit(self) -> list[Choice]:
        """The waiting choices that join the batch now; those that cannot wait longer are ended."""
        with self._cond:
            for choice in [c for c in self._waiting if c.task.job.cancel.is_set()]:
                self._cancel(choice.task)
            late = [c for c in self._waiting if self._out_of_time(c.task.job)]
            gone = {id(c) for c in late}
            self._waiting = deque(c for c in self._waiting if id(c) not in gone)
            if not self.generating and self._waiting and self._waiting[0].task.run is not self._run:
                self._run = self._waiting[0].task.run
                self._engine = Engine(
                    self._run.model, rows=self.capacity, dtype=self._run.dtype, decode=self._run.decoding.step
                )
            taken = []
            while (
                self._waiting
                and self.generating + len(taken) < self.capacity
                and self._waiting[0].task.run is self._run
            ):
                taken.append(self._waiting.popleft())
        for choice in late:
            self._late(choice)
        return taken

    def _late(self, choice: Choice) -> None:
        """A choice still waiting at its request's time limit (or at shutdown): "length" with no text if its
        request has begun, else the request fails (429, or 503 when shutting down)."""
        if choice.task.ended.is_set():
            return
        if choice.task.began:
            self._begin(choice)
            self._finish(choice, "length")
        elif self.stopping.is_set():
            message = "the server is shutting down; retry later"
            self._fail(choice.task, ApiError(503, message, None, "server_shutting_down"))
        else:
            message = "the server stayed busy for this request's whole time limit"
            self._fail(choice.task, ApiError(429, message, None, "server_busy"))

    def _begin(self, choice: Choice) -> None:
        """Its request's first event (once per request), then the choice's echo of its prompt."""
        task = choice.task
        if not task.began:
            task.began = True
            task.job.emit(task.started)
        if task.job.req.echo:
            task.job.emit(Text(choice.index, task.run.tokenizer.decode(choice.seq.ids[: choice.seq.prompt_tokens])))

    def _enter(self, choice: Choice) -> None:
        """Start a choice: its request's first event and its echo; then the engine prefills it when a row is free."""
        if choice.task.ended.is_set():
            return
        self._begin(choice)
        if self._out_of_time(choice.task.job):
            self._finish(choice, "length")
            return
        self._in[choice.seq] = choice
        self._engine.submit(choice.seq)

    def _expire(self) -> None:
        """End the choices whose client went away or whose time is up before the engine's next token."""
        for choice in list(self._in.values()):
            if choice.task.job.cancel.is_set():
                self._cancel(choice.task)
            elif not choice.task.ended.is_set() and self._out_of_time(choice.task.job):
                self._remove(choice)
                self._finish(choice, "length")

    def _take(self, choice: Choice, seq: Sequence, token: int, stop: bool) -> bool:
        """Report the choice's next token (the engine's watcher); True when a stop sequence ended it."""
        choice.task.job.finish_part(choice.index, choice.text, "stop" if stop else None, token)
        return choice.text.finish_reason is not None

    def _left(self, choice: Choice, seq: Sequence) -> None:
        """The engine ended the choice: at a stop (reported as its token came) or its length."""
        self._in.pop(seq, None)
        if choice.text.finish_reason is None:
            choice.task.job.finish_part(choice.index, choice.text, seq.finish)
        self._ended(choice)

    def _finish(self, choice: Choice, reason: str) -> None:
        if not choice.task.job.cancel.is_set():
            choice.task.job.finish_part(choice.index, choice.text, reason)
        self._ended(choice)

    def _ended(self, choice: Choice) -> None:
        task = choice.task
        task.completion_tokens += len(choice.text.ids)
        task.unfinished -= 1
        if not task.unfinished:
            usage = {"prompt_tokens": task.prompt_tokens, "completion_tokens": task.completion_tokens}
            self._close(task, Done({**usage, "total_tokens": task.prompt_tokens + task.completion_tokens}))

    def _fail(self, task: Task, error: ApiError) -> None:
        self._close(task, Failed(error))

    def _cancel(self, task: Task) -> None:
        self._close(task, None)

    def _close(self, task: Task, result: Event | None) -> None:
        """End the task: none of its choices stays in the batch or waits."""
        if task.ended.is_set():
            return
        for choice in task.choices:
            self._remove(choice)
        with self._cond:
            self._waiting = deque(c for c in self._waiting if c.task is not task)
        task.ended.set()
        task.end(result)

    def _remove(self, choice: Choice) -> None:
        """Take a choice out of the engine (a no-op if it is not in it), freeing its row."""
        if self._in.pop(choice.seq, None) is not None:
            self._engine.remove(choice.seq)

    def _out_of_time(self, job: Job) -> bool:
        return self.stopping.is_set() or time.monotonic() >= job.deadline
