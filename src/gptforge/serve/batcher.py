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
from dataclasses import dataclass, field

import torch

from gptforge.checkpoint import Inference
from gptforge.data.fim import end_ids
from gptforge.errors import GptforgeError
from gptforge.model.generate import Sampling, forward_logits, sample_rows
from gptforge.model.kv_cache import KVCache, RowCache
from gptforge.runtime.device import autocast
from gptforge.serve.jobs import Done, Event, Failed, Job, Started, Text
from gptforge.serve.protocol import ApiError
from gptforge.serve.text import Continuation


@dataclass
class Prefill:
    """A prompt run once for all of its choices: its cache (None at the full context) and next-token logits."""

    cache: KVCache | None
    logits: torch.Tensor
    waiting: int  # choices still to take it


@dataclass
class Task:
    """One request in the batcher: its choices still to end; `end` is told how it ended."""

    job: Job
    run: Inference
    started: Started
    end: Callable[[Event | None], None]  # told how it ended, once, from the batcher's thread
    prompt_tokens: int
    unfinished: int
    ends: set[int]
    began: bool = False
    completion_tokens: int = 0
    ended: threading.Event = field(default_factory=threading.Event)
    prefills: dict[int, Prefill] = field(default_factory=dict)


@dataclass(eq=False)
class Choice:
    """One completion of one prompt: its tokens (the prompt's first), its text so far, its own random stream."""

    task: Task
    index: int
    prompt: int
    ids: list[int]
    text: Continuation
    rule: Sampling
    generator: torch.Generator
    new: int = 0  # tokens generated


class Batcher:
    """Decodes up to `capacity` choices at a time, all of one model (requests for another wait their turn: the
    batch switches when it empties); the rest wait in arrival order."""

    def __init__(self, capacity: int, stopping: threading.Event) -> None:
        self.capacity, self.stopping = capacity, stopping
        self._cond = threading.Condition()
        self._waiting: deque[Choice] = deque()
        self._run: Inference | None = None  # the model the batch decodes
        self._cache: RowCache | None = None
        self._rows: list[Choice] = []  # row i of the cache
        self._past: list[Choice] = []  # past the context: each recomputes its last block_size tokens a step

    @property
    def generating(self) -> int:
        return len(self._rows) + len(self._past)

    def start(self) -> None:
        threading.Thread(target=self._serve, daemon=True, name="gptforge-batcher").start()

    def submit(
        self, job: Job, run: Inference, prompts: list[list[int]], started: Started, end: Callable[[Event | None], None]
    ) -> Task:
        """Queue every choice of `job` (n per prompt); `end` is told its last event."""
        req = job.req
        seed = secrets.randbits(63) if req.seed is None else req.seed % 2**63
        seeds = torch.randint(2**62, (len(prompts) * req.n,), generator=torch.Generator().manual_seed(seed))
        task = Task(job, run, started, end, sum(map(len, prompts)), len(seeds), end_ids(run.tokenizer))
        choices = [
            Choice(
                task,
                index=p * req.n + j,
                prompt=p,
                ids=list(ids),
                text=Continuation(run.tokenizer, req.stop),
                rule=Sampling(req.temperature, req.top_k, req.top_p),
                generator=torch.Generator(device=run.device).manual_seed(int(seeds[p * req.n + j])),
            )
            for p, ids in enumerate(prompts)
            for j in range(req.n)
        ]
        with self._cond:
            self._waiting.extend(choices)
            self._cond.notify()
        return task

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or self.generating)
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        """Let in the choices that fit, then decode one token for every choice in the batch."""
        entering: list[Choice] = []
        try:
            entering = self._admit()
            for choice in entering:
                self._enter(choice)
            self._decode()
        except Exception:  # noqa: BLE001 - a bug fails the requests in the batch, not the server
            traceback.print_exc()
            error = ApiError(500, "internal error in gptforge serve (its log has the traceback)")
            tasks = {id(c.task): c.task for c in [*entering, *self._rows, *self._past]}
            self._rows, self._past, self._run, self._cache = [], [], None, None  # the next batch starts afresh
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
                self._cache = RowCache(self._run.model.config, self.capacity, self._run.device)
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
            task.job.emit(Text(choice.index, task.run.tokenizer.decode(choice.ids)))

    def _enter(self, choice: Choice) -> None:
        """Start a choice: its request's first event, its echo, its prompt's prefill and first token; then a row."""
        if choice.task.ended.is_set():
            return
        self._begin(choice)
        if self._out_of_time(choice.task.job):
            self._finish(choice, "length")
            return
        prefill = self._prefill(choice)
        tokens = self._sample([choice], prefill.logits[None])
        if tokens is None or self._take(choice, tokens[0]):
            return
        if prefill.cache is not None:
            self._cache.add(prefill.cache)
            self._rows.append(choice)
        else:
            self._slide(choice)

    def _prefill(self, choice: Choice) -> Prefill:
        """The prompt's cache and logits, computed by its first choice and shared by the other n - 1."""
        task, model = choice.task, choice.task.run.model
        prefill = task.prefills.get(choice.prompt)
        if prefill is None:
            block = model.config.block_size
            cache = KVCache(model.config, 1, task.run.device) if len(choice.ids) < block else None
            idx = torch.tensor([choice.ids[-block:]], device=task.run.device)
            with autocast(task.run.device, task.run.dtype):
                logits = forward_logits(model, idx, cache)[0, -1]
            prefill = task.prefills[choice.prompt] = Prefill(cache, logits, task.job.req.n)
        prefill.waiting -= 1
        if not prefill.waiting:
            del task.prefills[choice.prompt]
        return prefill

    def _decode(self) -> None:
        """One token for every choice in the batch: the cached rows in one forward, those past the context in another,
        then every choice's token in one draw."""
        for choice in [*self._rows, *self._past]:
            if choice.task.job.cancel.is_set():
                self._cancel(choice.task)
            elif not choice.task.ended.is_set() and self._out_of_time(choice.task.job):
                self._remove(choice)
                self._finish(choice, "length")
        run = self._run
        block = run.model.config.block_size if run else 0
        lengths = self._cache.lengths if self._cache else []
        for choice in [c for c, n in zip(self._rows, lengths, strict=True) if n == block]:
            self._remove(choice)
            self._slide(choice)
        rows, past = list(self._rows), [c for c in self._past if not c.task.ended.is_set()]
        if not rows and not past:
            return
        logits = []
        with autocast(run.device, run.dtype):
            if rows:
                idx = torch.tensor([[c.ids[-1]] for c in rows], device=run.device)
                logits.append(forward_logits(run.model, idx, self._cache)[:, -1])
            if past:  # each exactly block_size tokens; batched, its logits round as the cached rows' do (~1e-7)
                idx = torch.tensor([c.ids[-block:] for c in past], device=run.device)
                logits.append(forward_logits(run.model, idx, None)[:, -1])
        # One draw for all: a draw per row past the context paid sample_rows' fixed cost once for each.
        for choice, token in zip(rows + past, self._sample(rows + past, torch.cat(logits)) or [], strict=False):
            if not choice.task.ended.is_set() and self._take(choice, token):
                self._remove(choice)

    def _slide(self, choice: Choice) -> None:
        """The choice fills the context: a completion goes on recomputing its last block_size tokens each step; an
        infill or a chat reply ends ("length"), since the window sliding past its start would drop its FIM sentinels
        or the template's opening of the conversation."""
        req = choice.task.job.req
        if req.suffix is None and req.messages is None:
            self._past.append(choice)
        else:
            self._finish(choice, "length")

    def _sample(self, choices: list[Choice], logits: torch.Tensor) -> list[int] | None:
        """Each choice's next token by its own rule and random stream; None when the model has diverged (then
        their requests have failed)."""
        uniforms = None
        if not all(c.rule.greedy for c in choices):
            draw = functools.partial(torch.rand, (), dtype=torch.float64, device=logits.device)
            unused = torch.zeros((), dtype=torch.float64, device=logits.device)  # a greedy row draws nothing
            uniforms = torch.stack([unused if c.rule.greedy else draw(generator=c.generator) for c in choices])
        try:
            return sample_rows(logits, [c.rule for c in choices], uniforms).tolist()
        except GptforgeError as e:  # the server is fine, this model is not
            for choice in choices:
                self._fail(choice.task, ApiError(503, str(e), None, "model_unavailable"))
            return None

    def _take(self, choice: Choice, token: int) -> bool:
        """Report the choice's next token; True when that ended the choice."""
        task, req = choice.task, choice.task.job.req
        choice.ids.append(token)
        choice.new += 1
        task.job.finish_part(choice.index, choice.text, "stop" if token in task.ends else None, token)
        if choice.text.finish_reason is None and choice.new >= req.max_tokens:
            task.job.finish_part(choice.index, choice.text, "length")
        if choice.text.finish_reason is not None:
            self._ended(choice)
            return True
        return False

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
        for choice in [c for c in [*self._rows, *self._past] if c.task is task]:
            self._remove(choice)
        with self._cond:
            self._waiting = deque(c for c in self._waiting if c.task is not task)
        task.prefills.clear()
        task.ended.set()
        task.end(result)

    def _remove(self, choice: Choice) -> None:
        """Take a choice out of the batch (a no-op if it is not in it); its row goes to the last row in use."""
        if choice in self._past:
            self._past.remove(choice)
        elif choice in self._rows:
            row = self._rows.index(choice)
            self._cache.remove(row)
            last = self._rows.pop()
            if row < len(self._rows):
                self._rows[row] = last

    def _out_of_time(self, job: Job) -> bool:
        return self.stopping.is_set() or time.monotonic() >= job.deadline
