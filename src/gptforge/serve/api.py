"""The OpenAI-compatible routes: GET /v1/models and POST /v1/completions, plain or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gptforge.files import to_json
from gptforge.serve.engine import Engine, Event, Job
from gptforge.serve.protocol import ApiError, CompletionRequest, choice, completion_object, parse_completion


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def routes(engine: Engine) -> list[Route]:
    async def list_models(request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": engine.models()})
        except ApiError as e:  # the served folder is gone
            return error_response(e)

    async def completions(request: Request) -> Response:
        events = None
        try:
            req = parse_completion(await _json_body(request, engine.limits.max_body_bytes), engine.limits)
            events = _events(engine, req, request)
            first = await anext(events)  # the model loaded and the prompts fit, or the error to answer with
            if first[0] == "error":
                raise first[1]
        except ApiError as e:
            if events is not None:
                await events.aclose()
            return error_response(e)
        rid = f"cmpl-{secrets.token_hex(12)}"
        if req.stream:
            chunks = _sse(events, req, rid, first[1])
            return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            return JSONResponse(await _gather(events, req, rid, first[1]))
        except ApiError as e:
            return error_response(e)

    return [Route("/v1/models", list_models), Route("/v1/completions", completions, methods=["POST"])]


async def _json_body(request: Request, limit: int):
    """The request's JSON, refusing a body over `limit` bytes (413) before reading it all."""
    if int(request.headers.get("content-length") or 0) > limit:
        raise ApiError(413, f"request body over {limit:,} bytes", None, "request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body over {limit:,} bytes", None, "request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None


async def _events(engine: Engine, req: CompletionRequest, request: Request) -> AsyncIterator[Event]:
    """The worker's events for one admitted request; the client going away (or this generator being closed)
    tells the worker to stop at its next token."""
    engine.admit()
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: Event) -> None:
        if not job.cancel.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
                loop.call_soon_threadsafe(queue.put_nowait, event)

    job = Job(req, emit, time.monotonic() + engine.limits.request_timeout)
    threading.Thread(target=engine.work, args=(job,), daemon=True).start()
    watcher = asyncio.create_task(_watch_disconnect(request, job.cancel, queue))
    try:
        while True:
            event = await queue.get()
            yield event
            if event[0] in ("done", "error"):
                return
    finally:
        job.cancel.set()
        watcher.cancel()


async def _watch_disconnect(request: Request, cancel: threading.Event, queue: asyncio.Queue) -> None:
    """Stop the worker when the client disconnects (the body is read by now, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()
    queue.put_nowait(("error", ApiError(499, "the client went away", None, "client_disconnected")))


async def _gather(events: AsyncIterator[Event], req: CompletionRequest, rid: str, fingerprint: str) -> dict:
    texts = [""] * (len(req.prompts) * req.n)
    reasons: list[str | None] = [None] * len(texts)
    try:
        async for event in events:
            if event[0] == "text":
                texts[event[1]] += event[2]
            elif event[0] == "finish":
                reasons[event[1]] = event[2]
            elif event[0] == "error":
                raise event[1]
            elif event[0] == "done":
                choices = [choice(i, t, r) for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
                return completion_object(rid, req.model, fingerprint, choices, event[1])
    finally:
        await events.aclose()
    raise AssertionError("the worker ended without 'done' or 'error'")


async def _sse(events: AsyncIterator[Event], req: CompletionRequest, rid: str, fingerprint: str):
    """OpenAI's stream: a `data: {chunk}` event per piece of text or finish, then `data: [DONE]`."""

    def data(obj) -> str:
        return f"data: {obj if isinstance(obj, str) else to_json(obj)}\n\n"

    try:
        async for event in events:
            if event[0] == "text":
                yield data(completion_object(rid, req.model, fingerprint, [choice(event[1], event[2], None)], None))
            elif event[0] == "finish":
                yield data(completion_object(rid, req.model, fingerprint, [choice(event[1], "", event[2])], None))
            elif event[0] == "error":  # the status line is sent already: the error goes in the stream
                yield data(event[1].body())
                return
            elif event[0] == "done":
                if req.include_usage:
                    yield data(completion_object(rid, req.model, fingerprint, [], event[1]))
                yield data("[DONE]")
    finally:
        await events.aclose()
