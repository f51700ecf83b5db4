"""`gptforge serve`'s flags: where it listens, who may call it, how much each request and the batch may take."""

from __future__ import annotations

import os

from gptforge import commands
from gptforge.cli.flags import THREADS_HELP, add_compute_flags, add_decoding_flags
from gptforge.cli.types import api_key, at_least, cors_origin, host_allowed
from gptforge.serve.protocol import MAX_CHOICES, MAX_PARALLEL


def add_serve_command(sub) -> None:
    """serve: the API and the page."""
    s = sub.add_parser("serve", help="OpenAI-compatible completions API + a web page with live curves (.[serve])")
    s.add_argument("path", metavar="PATH", help="a run folder, a checkpoint or a folder of runs")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need --api-key)")
    s.add_argument("--port", type=at_least(0), default=8000, help="TCP port (default 8000; 0 = any free port)")
    s.add_argument(
        "--api-key",
        type=api_key,
        default=os.environ.get("GPTFORGE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1, /api and /infill (default: $GPTFORGE_API_KEY, unseen by ps)",
    )
    s.add_argument("--max-tokens", type=at_least(1), default=1024, help="largest max_tokens a request may ask")
    s.add_argument(
        "--max-n", type=at_least(1, high=MAX_CHOICES), default=8, help="largest n (completions per prompt; default 8)"
    )
    s.add_argument(
        "--parallel",
        type=at_least(1, high=MAX_PARALLEL),
        default=8,
        help="completions generated together, a token a step for each (continuous batching; default 8)",
    )
    s.add_argument("--queue", type=at_least(0), default=8, help="requests waiting beyond --parallel; more: 429")
    s.add_argument(
        "--request-timeout", type=at_least(1.0, float), default=120.0, help="seconds a request may take (default 120)"
    )
    s.add_argument(
        "--read-timeout",
        type=at_least(0.1, float),
        default=30.0,
        help="seconds to send a request's head, then its body; a stalled one is cut off (default 30)",
    )
    s.add_argument(
        "--cors",
        action="append",
        type=cors_origin,
        default=[],
        metavar="ORIGIN",
        help="allow browser calls from ORIGIN",
    )
    s.add_argument(
        "--allow-host",
        action="append",
        type=host_allowed,
        default=[],
        metavar="NAME",
        help="answer requests whose Host is NAME too ('*': any); by default only the --host address's names",
    )
    add_compute_flags(s, threads_help=f"{THREADS_HELP}; 1 beside a CPU training run")
    add_decoding_flags(s)
    s.set_defaults(func=commands.cmd_serve)
