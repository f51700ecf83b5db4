"""A bounded load test of `gptforge serve`: k concurrent clients send a fixed count of completions.

    python benchmarks/serve.py PATH [--clients 4] [--requests 64] [--max-tokens 64] [--prompt TEXT] [--stream]
                                    [--queue N] [--threads N]

Starts `gptforge serve PATH` on a free port of 127.0.0.1 (its --queue: every client, unless --queue), sends
--requests completions from --clients threads, then prints p50/p99 latency (time to the whole answer; with
--stream, also to the first token), generated tokens/s over the whole run, how many were refused (429), and
whether the server still answers /v1/models afterwards.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def start_server(path: str, queue: int, flags: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "gptforge", "serve", path, "--port", "0", "--queue", str(queue), *flags]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    url = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not url:
        server.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return server, url.group(0)


def post(url: str, body: dict) -> tuple[float, float, int, int]:
    """(seconds to the whole answer, seconds to the first streamed piece, completion tokens, HTTP status)."""
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            if not body.get("stream"):
                usage = json.load(r)["usage"]
                return time.perf_counter() - t0, time.perf_counter() - t0, usage["completion_tokens"], 200
            tokens = 0
            for line in r:
                if line.startswith(b"data: {"):
                    first = first or time.perf_counter() - t0
                    chunk = json.loads(line[6:])
                    tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
            return time.perf_counter() - t0, first or 0.0, tokens, 200
    except urllib.error.HTTPError as e:
        return time.perf_counter() - t0, 0.0, 0, e.code


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a run folder or checkpoint for `gptforge serve`")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--stream", action="store_true", help="stream, and time the first token too")
    p.add_argument("--queue", type=int, help="the server's --queue (default: --clients, so none is refused)")
    p.add_argument("--threads", help="the server's --threads")
    args = p.parse_args()
    flags = ("--threads", args.threads) if args.threads else ()
    server, url = start_server(args.path, args.clients if args.queue is None else args.queue, flags)
    try:
        model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=60))["data"][0]["id"]
        body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 1.0}
        body |= {"stream": True, "stream_options": {"include_usage": True}} if args.stream else {}
        post(url, body | {"max_tokens": 4})  # loads the checkpoint: not part of the figures
        seeds = iter(range(args.requests))
        lock = threading.Lock()

        def one(_: int) -> tuple[float, float, int, int]:
            with lock:
                seed = next(seeds)
            return post(url, body | {"seed": seed})

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(one, range(args.requests)))
        wall = time.perf_counter() - t0
        report(args, results, wall, url)
    finally:
        server.terminate()
        server.wait(timeout=30)


def report(args: argparse.Namespace, results: list[tuple[float, float, int, int]], wall: float, url: str) -> None:
    ok = [r for r in results if r[3] == 200]
    latency = [r[0] for r in ok]
    tokens = sum(r[2] for r in ok)
    print(f"{args.requests} requests from {args.clients} clients, max_tokens {args.max_tokens}, in {wall:.1f} s")
    print(
        f"answered {len(ok)}, refused (429) {sum(r[3] == 429 for r in results)}, other errors "
        f"{sum(r[3] not in (200, 429) for r in results)}"
    )
    print(f"latency p50 {statistics.median(latency):.3f} s, p99 {percentile(latency, 99):.3f} s")
    if args.stream:
        first = [r[1] for r in ok]
        print(f"first token p50 {statistics.median(first):.3f} s, p99 {percentile(first, 99):.3f} s")
    print(f"generated {tokens} tokens: {tokens / wall:.1f} tokens/s")
    alive = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=60))["data"]
    print(f"afterwards /v1/models answers: {[m['id'] for m in alive]}")


if __name__ == "__main__":
    main()
