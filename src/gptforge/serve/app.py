"""`gptforge serve PATH`: the app (API + page), its safety defaults, and the server that binds it."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from pathlib import Path

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gptforge.errors import GptforgeError
from gptforge.serve import api, page
from gptforge.serve.engine import Engine
from gptforge.serve.protocol import ApiError, Limits
from gptforge.serve.runs import check_root, find_sources

GUARDED = ("/v1/", "/api/")  # the page and its static files load without the key; the page then asks for it


class RequireKey:
    """Answers 401 in OpenAI's form to a /v1 or /api request without `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                error = ApiError(
                    401, "missing or incorrect API key (send Authorization: Bearer KEY)", None, "invalid_api_key"
                )
                await api.error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    root: Path,
    api_key: str | None = None,
    limits: Limits | None = None,
    cors: tuple[str, ...] = (),
    device: str = "auto",
    dtype: str = "auto",
) -> Starlette:
    engine = Engine(root, limits or Limits(), device, dtype)
    middleware = [Middleware(RequireKey, key=api_key)] if api_key else []
    if cors:  # only when asked: a page on another site could otherwise drive this server from a visitor's browser
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            ),
        )
    return Starlette(routes=[*api.routes(engine), *page.routes(root)], middleware=middleware)


def check_binding(host: str, api_key: str | None) -> None:
    """Anything but loopback is reachable by others: it needs a key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise GptforgeError(
            f"--host {host} lets anyone who can reach this machine run the model and read the runs: "
            "give --api-key KEY too (or keep the default --host 127.0.0.1)"
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, so a busy port is a one-line error and --port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:  # OverflowError: a port past 65535
        sock.close()
        raise GptforgeError(
            f"--host {host} --port {port}: cannot listen there ({getattr(e, 'strerror', None) or e})"
        ) from None
    sock.listen(128)
    return sock


def serve(
    path: str,
    host: str,
    port: int,
    api_key: str | None,
    limits: Limits,
    cors: tuple[str, ...] = (),
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
) -> None:
    """Serve until Ctrl-C; prints the address (with the port --port 0 chose) first."""
    root = check_root(path)
    check_binding(host, api_key)
    if threads:  # beside a training run on the same CPU, more threads than are free make each token far slower
        torch.set_num_threads(threads)
    sock = bind(host, port)
    app = build_app(root, api_key, limits, cors, device, dtype)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    names = ", ".join(find_sources(root)) or "none yet"
    print(f"serving {path} ({names}) at {url}/  OpenAI API: {url}/v1", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
