"""Generation for the server: the newest checkpoint of the named run, one request at a time on a worker thread,
a bounded number waiting, each stopped by its deadline or by its client going away."""

from __future__ import annotations

import secrets
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptforge.checkpoint import Inference, load_for_inference
from gptforge.data.fim import FIMTokenizer, end_ids, infill_prompt
from gptforge.errors import GptforgeError
from gptforge.model.generate import stream
from gptforge.runtime.device import autocast
from gptforge.serve.protocol import ApiError, CompletionRequest, Limits
from gptforge.serve.runs import FolderGone, find_sources
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


@dataclass(frozen=True)
class Done:
    usage: dict


@dataclass(frozen=True)
class Failed:
    """Instead of all the others, or after some of them when generation fails midway."""

    error: ApiError


# What the worker reports, in order: Started, then Text and Finish per choice, then Done; or Failed.
Event = Started | Text | Finish | Done | Failed
KEEP_MODELS = 2  # loaded checkpoints kept, newest use first (a page switching between two runs reloads nothing)


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
            self.emit(Finish(index, text.finish_reason))


class Engine:
    """Serves the runs under `root`: admits requests up to the queue's bound and runs them one at a time."""

    def __init__(self, root: Path, limits: Limits, device: str = "auto", dtype: str = "auto") -> None:
        self.root, self.limits, self.device, self.dtype = root, limits, device, dtype
        self._model_lock = threading.Lock()  # one generation at a time: it uses every core (or the GPU) already
        self._count_lock = threading.Lock()
        self.in_flight = 0
        self.stopping = threading.Event()  # see stop()
        self._loaded: OrderedDict[str, tuple[Path, Inference]] = OrderedDict()

    def admit(self) -> None:
        """Count a request in, or answer 429 when one is generating and `limits.queue` more are waiting."""
        with self._count_lock:
            if self.in_flight >= 1 + self.limits.queue:
                raise ApiError(
                    429, f"the server is busy ({self.in_flight} requests in flight); retry later", None, "server_busy"
                )
            self.in_flight += 1

    def stop(self) -> None:
        """The server is shutting down: a request generating ends its choices as "length" at its next token (its
        stream then ends as usual, with [DONE]); those still waiting are answered 503."""
        self.stopping.set()

    def work(self, job: Job) -> None:
        """The worker thread of one admitted request; `job.cancel` set by the client going away ends it."""
        last: Event | None = None
        try:
            if not self._model_lock.acquire(timeout=max(0.0, job.deadline - time.monotonic())):
                raise ApiError(429, "the server stayed busy for this request's whole time limit", None, "server_busy")
            try:  # a client that left while waiting costs nothing more
                if self.stopping.is_set():
                    raise ApiError(503, "the server is shutting down; retry later", None, "server_shutting_down")
                usage = None if job.cancel.is_set() else self._generate(job)
            finally:
                self._model_lock.release()
            last = Done(usage) if usage else None
        except ApiError as e:
            last = Failed(e)
        except GptforgeError as e:  # a damaged checkpoint, a diverged model: the server is fine, this model is not
            last = Failed(ApiError(503, str(e), None, "model_unavailable"))
        except Exception:  # noqa: BLE001 - a bug must not take the worker's slot with it
            traceback.print_exc()
            last = Failed(ApiError(500, "internal error in gptforge serve (its log has the traceback)"))
        finally:
            with self._count_lock:  # before the last event: a client that has its answer finds the slot free
                self.in_flight -= 1
        if last is not None:
            job.emit(last)

    def _generate(self, job: Job) -> dict[str, int] | None:
        """Generate every choice of the request; returns the usage, or None when the client went away."""
        req = job.req
        name, ckpt, run = self.model(req.model)
        prompts = [self._encode(run, p, req) for p in req.prompts]
        job.emit(Started(ckpt.name, name))
        seed = secrets.randbits(63) if req.seed is None else req.seed % 2**63
        g = torch.Generator(device=run.device).manual_seed(seed)
        generated = 0
        for i, ids in enumerate(prompts):
            generated += self._complete(job, run, ids, i * req.n, g)
            if job.cancel.is_set():
                return None
        prompt_tokens = sum(map(len, prompts))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }

    def _complete(self, job: Job, run: Inference, ids: list[int], first: int, g: torch.Generator) -> int:
        """Stream the n choices of one prompt (choice indices from `first`); returns the tokens they generated."""
        req, tok = job.req, run.tokenizer
        texts = [Continuation(tok, req.stop) for _ in range(req.n)]
        if req.echo:
            for j in range(req.n):
                job.emit(Text(first + j, tok.decode(ids)))
        ends = end_ids(tok)
        steps = stream(run.model, ids, req.max_tokens, req.n, req.temperature, req.top_k, req.top_p, tok.eot, g)
        while not job.cancel.is_set() and not self.stopping.is_set() and time.monotonic() < job.deadline:
            with autocast(run.device, run.dtype):  # around the model only
                nxt = next(steps, None)
            if nxt is None:
                break
            for j, token in enumerate(nxt.tolist()):
                if texts[j].finish_reason is None:
                    job.finish_part(first + j, texts[j], "stop" if token in ends else None, token)
            if all(c.finish_reason for c in texts):
                break
        if not job.cancel.is_set():
            for j, c in enumerate(texts):
                if c.finish_reason is None:  # max_tokens, the time limit or a shutdown
                    job.finish_part(first + j, c, "length")
        return sum(len(c.ids) for c in texts)

    def _encode(self, run: Inference, prompt: str | list[int], req: CompletionRequest) -> list[int]:
        """Token ids of a prompt (an infill's: prefix, suffix and the middle's start between FIM sentinels); one
        longer than the model's context is refused, as OpenAI's API does."""
        tok = run.tokenizer
        if req.suffix is not None:
            if not isinstance(tok, FIMTokenizer):
                raise ApiError(
                    400,
                    f"the model '{req.model}' was trained without fill-in-the-middle (data.fim_rate=0), so it cannot "
                    "infill; train one with --set data.fim_rate=0.5",
                    "suffix",
                    "unsupported",
                )
            ids = infill_prompt(tok, prompt, req.suffix) + tok.encode(req.middle)
        else:
            ids = prompt if isinstance(prompt, list) else tok.encode(prompt) or [tok.eot]  # "" starts a document
        if any(not 0 <= t < tok.vocab_size for t in ids):
            raise ApiError(400, f"token ids must be in [0, {tok.vocab_size})", "prompt", "invalid_value")
        block = run.model.config.block_size
        if len(ids) > block:
            raise ApiError(
                400,
                f"this model's maximum context length is {block} tokens, but the prompt has {len(ids)}",
                "prompt",
                "context_length_exceeded",
            )
        return ids

    def model(self, name: str) -> tuple[str, Path, Inference]:
        """The run's newest intact checkpoint, loaded (again only when training has written a newer one); no name
        (llama.cpp's /infill sends none) means the only run served."""
        sources = find_sources(self.root)
        if not name and len(sources) == 1:
            name = next(iter(sources))
        elif not name:
            raise ApiError(400, f"'model' is required: {len(sources)} runs are served (GET /v1/models)", "model")
        source = sources.get(name)
        newest = source.newest_checkpoint() if source else None
        if newest is None:
            raise ApiError(
                404, f"the model '{name}' does not exist; GET /v1/models lists those served", "model", "model_not_found"
            )
        loaded = self._loaded.get(name)
        if loaded is None or loaded[0] != newest:
            ckpt = source.intact_checkpoint()  # skips a damaged newest one, with a warning
            if loaded is None or loaded[0] != ckpt:
                loaded = (ckpt, load_for_inference(ckpt, self.device, self.dtype))
        self._loaded[name] = loaded
        self._loaded.move_to_end(name)
        while len(self._loaded) > KEEP_MODELS:
            self._loaded.popitem(last=False)
        return name, *loaded

    def models(self) -> list[dict[str, Any]]:
        """The OpenAI model objects: every run with a checkpoint, and which checkpoint a request would get."""
        try:
            sources = find_sources(self.root)
        except FolderGone as e:
            raise ApiError(503, str(e), None, "model_unavailable") from None
        out = []
        for name, source in sources.items():
            ckpt = source.newest_checkpoint()
            try:
                created = int(ckpt.stat().st_mtime) if ckpt else None
            except FileNotFoundError:  # pruned by training a moment ago
                created = None
            if created is not None:
                out.append(
                    {"id": name, "object": "model", "created": created, "owned_by": "gptforge", "checkpoint": ckpt.name}
                )
        return out
