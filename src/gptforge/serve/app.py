"""`gptforge serve PATH`: the app (API + page), its safety defaults, and the server that binds it."""

from __future__ import annotations

import contextlib
import functools
import gc
import hmac
import http
import ipaddress
import json
import signal
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import h11
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from gptforge.errors import GptforgeError
from gptforge.model.engine import FLOAT_ROWS, Decoding
from gptforge.runtime.device import resolve_device
from gptforge.serve import api, page
from gptforge.serve.engine import Engine
from gptforge.serve.protocol import ApiError, Limits, allowed_host, host_arg, host_name
from gptforge.serve.runs import check_root, find_sources

GUARDED = ("/v1/", "/api/", "/infill")  # the page and its static files load without the key; the page then asks for it
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
EVERY_ADDRESS = ("0.0.0.0", "::", "")
CORS_METHODS = ("GET", "POST")  # what --cors lets another site's page do: the API's routes and the page's JSON
CORS_HEADERS = ("Authorization", "Content-Type")


@dataclass(frozen=True)
class Hosts:
    """The names a request's Host header may give: `names` ('*' in it: any), or any IP address if `any_ip`."""

    names: frozenset[str]
    any_ip: bool = False

    def allows(self, name: str) -> bool:
        if "*" in self.names or name in self.names:
            return True
        if not self.any_ip:
            return False
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def hosts_for(host: str, allowed: tuple[str, ...] = ()) -> Hosts:
    """The Host names of a server bound to --host `host`: loopback's names, that address, or any IP address and
    localhost when bound to every address; plus the --allow-host names."""
    names = set()
    for name in allowed:
        try:
            names.add(allowed_host(name))
        except ValueError as e:
            raise GptforgeError(f"--allow-host {name!r}: {e}") from None
    bound = host_arg(host)
    every = bound in EVERY_ADDRESS
    if every or _is_loopback(bound):
        names |= LOOPBACK
    return Hosts(frozenset(names | {bound} - {""}), any_ip=every)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CheckHost:
    """Answers 400 in OpenAI's form to a request whose Host is not a name of this server: a web page on a name
    that its DNS then points at this machine (DNS rebinding) could otherwise read the runs and drive the model."""

    def __init__(self, app: ASGIApp, hosts: Hosts) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host_name(header)
            if not name or not self.hosts.allows(name):
                error = ApiError(
                    400,
                    f"this server does not answer to the Host {header!r} "
                    f"(start it with --allow-host {name or 'NAME'} to reach it by that name)",
                    None,
                    "invalid_host",
                )
                await api.error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OneBodyLength:
    """Answers 400 and closes the connection when a request gives both Content-Length and Transfer-Encoding (RFC
    9112 §6.3): h11 reads the chunked body and keeps the connection open, so behind a proxy that went by
    Content-Length the bytes after the chunks would be served as a second, smuggled request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        names = {name.lower() for name, _ in scope.get("headers", ())} if scope["type"] == "http" else set()
        if {b"content-length", b"transfer-encoding"} <= names:
            error = ApiError(
                400, "a request may give Content-Length or Transfer-Encoding, not both", None, "ambiguous_length"
            )
            await api.error_response(error, {"Connection": "close"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequireKey:
    """Answers 401 in OpenAI's form to a /v1 or /api request without `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED) and scope["method"] != "OPTIONS":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the scheme's case does not matter (RFC 9110 11.1): some clients send "bearer"
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.lstrip(b" "), self.key):
                error = ApiError(
                    401, "missing or incorrect API key (send Authorization: Bearer KEY)", None, "invalid_api_key"
                )
                await api.error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in OpenAI's form like every other error (Starlette's
    is plain text); its status stays Starlette's 400, and an allowed preflight is Starlette's answer unchanged."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")  # e.g. "origin, method"
        origin, method = request_headers["origin"], request_headers["access-control-request-method"]
        message = (
            f"CORS preflight refused: its {refused} not allowed (Origin {origin!r}, method {method!r}); this server "
            f"allows the origins given to --cors, the methods {', '.join(CORS_METHODS)} and the headers "
            f"{', '.join(CORS_HEADERS)}"
        )
        kept = {k: v for k, v in response.headers.items() if k not in ("content-type", "content-length")}
        return api.error_response(ApiError(400, message, None, "cors_refused"), kept)


def build_app(
    root: Path,
    api_key: str | None = None,
    limits: Limits | None = None,
    cors: tuple[str, ...] = (),
    device: str = "auto",
    dtype: str = "auto",
    hosts: Hosts | None = None,
    decoding: Decoding = FLOAT_ROWS,
) -> Starlette:
    """The app; `hosts` None answers any Host (for a caller that is the only one to reach it, as tests are)."""
    engine = Engine(root, limits or Limits(), device, dtype, decoding)
    middleware = [Middleware(RequireKey, key=api_key)] if api_key else []
    if cors:  # only when asked: a page on another site could otherwise drive this server from a visitor's browser
        middleware.insert(
            0,
            Middleware(
                Cors,
                allow_origins=list(cors),
                allow_methods=list(CORS_METHODS),
                allow_headers=list(CORS_HEADERS),
            ),
        )
    if hosts is not None:
        middleware.insert(0, Middleware(CheckHost, hosts=hosts))
    middleware.insert(0, Middleware(OneBodyLength))  # first: nothing else reads a request framed two ways
    app = Starlette(
        routes=[*api.routes(engine), *page.routes(root)],
        middleware=middleware,
        exception_handlers={404: api.no_route, 405: api.no_route},
    )
    app.state.engine = engine
    return app


def check_binding(host: str, api_key: str | None, allow_hosts: tuple[str, ...] = ()) -> None:
    """Anything but loopback is reachable by others: it needs a key. So is a server that answers any Host: any web
    page its user opens can reach it by DNS rebinding (a name of the page's own that resolves to this machine)."""
    if not _is_loopback(host) and not api_key:
        raise GptforgeError(
            f"--host {host} lets anyone who can reach this machine run the model and read the runs: "
            "give --api-key KEY too (or keep the default --host 127.0.0.1)"
        )
    if "*" in allow_hosts and not api_key:
        raise GptforgeError(
            "--allow-host '*' lets any web page its user opens run the model and read the runs (by DNS rebinding): "
            "give --api-key KEY too, or name the hosts (--allow-host myhost.lan)"
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
    *,
    host: str,
    port: int,
    api_key: str | None,
    limits: Limits,
    cors: tuple[str, ...] = (),
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    allow_hosts: tuple[str, ...] = (),
    decoding: Decoding = FLOAT_ROWS,
) -> None:
    """Serve until Ctrl-C or SIGTERM; prints the address (with the port --port 0 chose) first."""
    root = check_root(path)
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address as a URL writes it: [::1] was not loopback
        host = host[1:-1]
    check_binding(host, api_key, allow_hosts)
    resolve_device(device, "--device")  # a device this machine lacks is refused now, not a 503 to every request
    hosts = hosts_for(host, allow_hosts)
    if threads:  # beside a training run on the same CPU, more threads than are free make each token far slower
        torch.set_num_threads(threads)
    sock = bind(host, port)
    app = build_app(
        root, api_key=api_key, limits=limits, cors=cors, device=device, dtype=dtype, hosts=hosts, decoding=decoding
    )
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    print(banner(path, find_sources(root), url), flush=True)
    config = uvicorn.Config(
        app,
        http=functools.partial(BoundedH11, read_timeout=limits.read_timeout),
        lifespan="off",  # nothing to start or stop; a second Ctrl-C skips its stop, and its task logged a traceback
        ws="none",  # no route takes a WebSocket (and an upgraded connection would keep BoundedH11's timer)
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    # The interpreter's last collection at exit walked every object torch made at import: 4 s after a SIGTERM on a
    # busy 2-core machine. Frozen, they are skipped there (and in the full collections while serving).
    gc.freeze()
    previous = signal.signal(signal.SIGTERM, _terminated)
    # Started as a script's background job (`gptforge serve ... &`), SIGINT is ignored from the start and uvicorn's
    # re-raise of it after shutdown did nothing: Ctrl-C ended as "stopped", exit 0, unlike in a terminal (130).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with contextlib.suppress(Terminated):
            Server(config, app.state.engine).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    print("gptforge serve: stopped", file=sys.stderr, flush=True)


def banner(path: str, names: Iterable[str], url: str) -> str:
    """The line serve starts with, which scripts read the address from: a path or run name holding a newline or
    another control character is shown as repr writes it, so the line stays one (the model's id is the name)."""
    shown = ", ".join(map(_printable, names)) or "none yet"
    return f"serving {_printable(path)} ({shown}) at {url}/  OpenAI API: {url}/v1"


def _printable(name: str) -> str:
    return name if name.isprintable() else repr(name)


class Terminated(Exception):
    """SIGTERM, once uvicorn has shut down (it raises the signal again then): a clean end, exit status 0."""


def _terminated(signum, frame) -> None:
    raise Terminated


class Server(uvicorn.Server):
    """uvicorn's server, which on shutdown first ends the completions being generated: their streams then send
    their last chunks and [DONE] within uvicorn's grace period, rather than being cut off at its end."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        busy = self.engine.in_flight
        requests = f"{busy} request{'s' * (busy != 1)}"
        print(f"gptforge serve: shutting down ({requests} in flight)", file=sys.stderr, flush=True)
        self.engine.stop()
        await super().shutdown(sockets)


class BoundedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a time limit on a request's head: its own keep-alive timer starts again
    with every byte, so a client sending half a head and then nothing (or a byte a minute) held its connection
    for ever. The body has its limit in api._json_body. What uvicorn answers itself is in OpenAI's form."""

    def __init__(self, *args, read_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout, self.head_timer = read_timeout, None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._wait_for_head()

    def on_response_complete(self) -> None:
        self._wait_for_head()
        super().on_response_complete()  # may start a pipelined request, whose head is here already

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request's head has arrived
            self._stop_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a malformed head or chunk), answered in OpenAI's form, not as plain text."""
        self._answer(ApiError(400, f"{msg} (not HTTP/1.1 as RFC 9112 frames it)", None, "invalid_http_request"))

    def shutdown(self) -> None:
        """A request whose body is still arriving is answered 503 now: it held the shutdown for uvicorn's whole grace
        period, then was cancelled with a traceback in the log and a plain-text 500 to the client."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.conn.their_state is not h11.SEND_BODY:
            super().shutdown()
            return
        cycle.disconnected = True  # the app's next receive() says so: it stops reading and answers no one
        cycle.message_event.set()
        self._answer(ApiError(503, "the server is shutting down; retry later", None, "server_shutting_down"))

    def _answer(self, error: ApiError) -> None:
        """Send `error` as the whole response (unless one was sent: a bad chunk after a GET's answer), then close."""
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        reason = http.HTTPStatus(error.status).phrase.encode()
        response = h11.Response(status_code=error.status, headers=[*headers, (b"connection", b"close")], reason=reason)
        with contextlib.suppress(h11.LocalProtocolError):  # a response went out already: closing is all that is left
            self.transport.write(
                b"".join(self.conn.send(e) for e in (response, h11.Data(data=body), h11.EndOfMessage()))
            )
        self.transport.close()

    def _wait_for_head(self) -> None:
        self._stop_timer()
        # what uvicorn does at the end of its keep-alive time: close the connection (unless closing already)
        self.head_timer = self.loop.call_later(self.read_timeout, self.timeout_keep_alive_handler)

    def _stop_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
