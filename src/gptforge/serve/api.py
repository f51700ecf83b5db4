"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions, plain or streamed
as server-sent events; llama.cpp's POST /infill."""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gptforge.files import to_json
from gptforge.inputs import parse_json
from gptforge.serve.engine import Engine
from gptforge.serve.jobs import Done, Event, Failed, Finish, Job, Started, Text
from gptforge.serve.mailbox import mailbox
from gptforge.serve.protocol import (
    CHAT,
    COMPLETION,
    ApiError,
    CompletionRequest,
    Limits,
    Shape,
    parse_chat,
    parse_completion,
    parse_infill,
)

ROUTES = "gptforge serve answers GET /v1/models, POST /v1/completions, POST /v1/chat/completions and POST /infill"


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error body, ASCII-escaped: a message may quote the client's own string, lone surrogates and all."""
    if e.status in (408, 413):  # answered before the body was read to its end: the rest is not worth waiting for
        headers = {**(headers or {}), "Connection": "close"}
    return Response(json.dumps(e.body()), e.status, headers, media_type="application/json")


def no_route(request: Request, exc: HTTPException) -> Response:
    """Starlette's 404 and 405, in OpenAI's form under /v1 and /api (plain text for the page's files)."""
    path = request.url.path
    if not path.startswith(("/v1/", "/api/")) and path not in ("/v1", "/api"):
        return PlainTextResponse(exc.detail, exc.status_code, exc.headers)
    if exc.status_code == 405:
        message = f"Invalid method for URL ({request.method} {path}): use {exc.headers.get('Allow', 'another')}"
    else:
        message = f"Invalid URL ({request.method} {path}): {ROUTES}"
    return error_response(ApiError(exc.status_code, message), exc.headers)


def routes(engine: Engine) -> list[Route]:
    def list_models(request: Request) -> Response:
        """A plain function, which Starlette runs on its thread pool: the checkpoints' files it reads (a slow disk,
        a FIFO that never opens) do not hold up every other client."""
        try:
            return JSONResponse({"object": "list", "data": engine.models()})
        except ApiError as e:  # the served folder is gone
            return error_response(e)

    def answering(parse: Callable, stream_of: Callable, gather: Callable) -> Callable:
        """A generating route: the body parsed, the request admitted and its model loaded (or the error to answer
        with), then the events as a stream or gathered into one JSON object."""

        async def route(request: Request) -> Response:
            events = None
            try:
                req = parse(await _json_body(request, engine.limits), engine.limits)
                events = _events(engine, req, request)
                first = await anext(events)  # the model loaded and the prompts fit, or the error to answer with
                if isinstance(first, Failed):
                    raise first.error
            except ApiError as e:
                if events is not None:
                    await events.aclose()
                return error_response(e)
            if req.stream:
                chunks = stream_of(events, req, first)
                return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                return JSONResponse(await gather(events, req, first))
            except ApiError as e:
                return error_response(e)

        return route

    completions = answering(
        parse_completion, functools.partial(_sse, COMPLETION), functools.partial(_gather, COMPLETION)
    )
    chat = answering(parse_chat, functools.partial(_sse, CHAT), functools.partial(_gather, CHAT))
    infill = answering(parse_infill, _infill_sse, _infill_gather)  # llama.cpp's, for editor plugins written for it

    return [
        Route("/v1/models", list_models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/infill", infill, methods=["POST"]),
    ]


async def _json_body(request: Request, limits: Limits):
    """The request's JSON: sent as application/json (else 415), at most `limits.max_body_bytes` (413), arriving
    within `limits.read_timeout` (408)."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":  # a web page can send the other types to any site without asking it first
        raise ApiError(
            415,
            f"send the body as JSON, with Content-Type: application/json (got {kind or 'none'})",
            None,
            "unsupported_media_type",
        )
    limit = limits.max_body_bytes
    try:
        if int(request.headers.get("content-length") or 0) > limit:
            await asyncio.wait_for(_discard(request, DISCARDED * limit), limits.read_timeout)
            raise ApiError(413, f"request body over {limit:,} bytes", None, "request_too_large")
        body = await asyncio.wait_for(_read(request, limit), limits.read_timeout)
    except asyncio.TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {limits.read_timeout:g} s", None, "request_timeout"
        ) from None
    except ClientDisconnect:
        raise ApiError(499, "the client went away", None, "client_disconnected") from None
    try:
        return parse_json(bytes(body))
    except ValueError as e:
        raise ApiError(400, f"the request body: {e}") from None


async def _read(request: Request, limit: int) -> bytearray:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            await _discard(request, (DISCARDED - 1) * limit)
            raise ApiError(413, f"request body over {limit:,} bytes", None, "request_too_large")
    return body


DISCARDED = 16  # a body over the limit is read and dropped up to this many times the limit before the 413


async def _discard(request: Request, cap: int) -> None:
    """Read what the client is still sending, so that closing the connection after the 413 does not reset it (a
    socket closed with unread data sends RST, and the client can lose the answer); past `cap`, stop reading."""
    seen = 0
    async for part in request.stream():
        seen += len(part)
        if seen > cap:
            return


async def _events(engine: Engine, req: CompletionRequest, request: Request) -> AsyncIterator[Event]:
    """The worker's events for one admitted request; the client going away (or this generator being closed)
    tells the worker to stop at its next token."""
    engine.admit()
    box, queue = mailbox(asyncio.get_running_loop()), asyncio.Queue()
    pieces: dict[int, list[str]] = {}  # a plain answer's text, and its other events, handed over with its end
    held: list[Event] = []  # Started, then the finishes
    first_text = True

    def emit(event: Event) -> None:
        # Nothing reads a plain answer before its end: waking the loop for every token of every request (a thread
        # switch each) set a small model's pace with 8 clients.
        nonlocal first_text
        if job.cancel.is_set():
            return
        if req.stream or isinstance(event, Done | Failed):
            texts = (Text(i, "".join(p)) for i, p in pieces.items())
            urgent = isinstance(event, Done | Failed) or (first_text and isinstance(event, Text))
            first_text = first_text and not isinstance(event, Text)
            box.post(queue, *held[:1], *texts, *held[1:], event, urgent=urgent)
        elif isinstance(event, Text):
            pieces.setdefault(event.index, []).append(event.piece)
        else:
            held.append(event)

    job = Job(req, emit, time.monotonic() + engine.limits.request_timeout)
    engine.start(job)
    watcher = asyncio.create_task(_watch_disconnect(request, job.cancel, queue))
    try:
        while True:
            for event in _merged([await queue.get(), *(queue.get_nowait() for _ in range(queue.qsize()))]):
                yield event
                if isinstance(event, (Done, Failed)):
                    return
    finally:
        job.cancel.set()
        watcher.cancel()


def _merged(events: list[Event]) -> list[Event]:
    """One Text for each run of a choice's pieces that arrived together: a stream's chunk (its JSON, its write,
    the client's parse) for each, not for each token."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Text) and isinstance(last, Text) and last.index == event.index:
            out[-1] = Text(event.index, last.piece + event.piece)
        else:
            out.append(event)
    return out


async def _watch_disconnect(request: Request, cancel: threading.Event, queue: asyncio.Queue) -> None:
    """Stop the worker when the client disconnects (the body is read by now, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()
    queue.put_nowait(Failed(ApiError(499, "the client went away", None, "client_disconnected")))


async def _gather(shape: Shape, events: AsyncIterator[Event], req: CompletionRequest, first: Started) -> dict:
    rid, fingerprint = f"{shape.id_prefix}-{secrets.token_hex(12)}", first.fingerprint
    texts = [""] * (len(req.prompts) * req.n)
    reasons: list[str | None] = [None] * len(texts)
    try:
        async for event in events:
            if isinstance(event, Text):
                texts[event.index] += event.piece
            elif isinstance(event, Finish):
                reasons[event.index] = event.reason
            elif isinstance(event, Failed):
                raise event.error
            elif isinstance(event, Done):
                choices = [shape.choice(i, t, r, False) for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
                return shape.answer(rid, req.model, fingerprint, choices, event.usage, streamed=False)
    finally:
        await events.aclose()
    raise AssertionError("the worker ended without 'done' or 'error'")


async def _sse(shape: Shape, events: AsyncIterator[Event], req: CompletionRequest, first: Started):
    """OpenAI's stream: a `data: {chunk}` event per piece of text or finish, then `data: [DONE]`; a chat stream
    opens each choice with its role."""
    rid, fingerprint = f"{shape.id_prefix}-{secrets.token_hex(12)}", first.fingerprint

    def data(obj) -> str:
        return f"data: {obj if isinstance(obj, str) else to_json(obj)}\n\n"

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return data(shape.answer(rid, req.model, fingerprint, choices, usage, streamed=True))

    try:
        if shape.chat:
            for index in range(len(req.prompts) * req.n):
                yield chunk([{**shape.choice(index, "", None, True), "delta": {"role": "assistant", "content": ""}}])
        async for event in events:
            if isinstance(event, Text):
                yield chunk([shape.choice(event.index, event.piece, None, True)])
            elif isinstance(event, Finish):
                yield chunk([shape.choice(event.index, "", event.reason, True)])
            elif isinstance(event, Failed):  # the status line is sent already: the error goes in the stream
                yield data(event.error.body())
                return
            elif isinstance(event, Done):
                if req.include_usage:
                    yield chunk([], event.usage)
                yield data("[DONE]")
    finally:
        await events.aclose()


STOP_TYPES = {"stop": "eos", "length": "limit"}  # llama.cpp's names for why a completion ended (or "word")


def _infill_object(model: str, content: str, finish: Finish | None, usage: dict | None = None) -> dict:
    """llama.cpp's answer object: a piece of text (finish None), or the last, saying why it stopped."""
    out = {"content": content, "stop": finish is not None, "model": model}
    if finish is not None:
        out["stop_type"] = "word" if finish.word else STOP_TYPES.get(finish.reason, finish.reason)
        out["stopping_word"] = finish.word or ""
    if usage is not None:
        out.update(tokens_predicted=usage["completion_tokens"], tokens_evaluated=usage["prompt_tokens"])
    return out


async def _infill_gather(events: AsyncIterator[Event], req: CompletionRequest, first: Started) -> dict:
    content, finish, model = "", None, first.model
    try:
        async for event in events:
            if isinstance(event, Text):
                content += event.piece
            elif isinstance(event, Finish):
                finish = event
            elif isinstance(event, Failed):
                raise event.error
            elif isinstance(event, Done):
                return _infill_object(model, content, finish or Finish(0, "length"), event.usage)
    finally:
        await events.aclose()
    raise AssertionError("the worker ended without 'done' or 'error'")


async def _infill_sse(events: AsyncIterator[Event], req: CompletionRequest, first: Started):
    """llama.cpp's stream: a `data: {"content", "stop": false}` event per piece, then one with "stop": true."""
    finish, model = None, first.model
    try:
        async for event in events:
            if isinstance(event, Text):
                yield f"data: {to_json(_infill_object(model, event.piece, None))}\n\n"
            elif isinstance(event, Finish):
                finish = event
            elif isinstance(event, Failed):
                yield f"data: {to_json(event.error.body())}\n\n"
                return
            elif isinstance(event, Done):
                yield f"data: {to_json(_infill_object(model, '', finish or Finish(0, 'length'), event.usage))}\n\n"
    finally:
        await events.aclose()
