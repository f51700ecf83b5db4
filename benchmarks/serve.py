"""A bounded load test of `gptforge serve`: k concurrent clients send a fixed count of completions.

    python benchmarks/serve.py PATH [--clients 1,8] [--requests 64] [--max-tokens 64] [--prompt TEXT] [--stream]
                                    [--queue N] [--parallel N] [--threads N] [--json FILE] [--decode-step]

Starts `gptforge serve PATH` on a free port of 127.0.0.1 (its --queue: every client, unless --queue), then for each
count in --clients in turn sends --requests completions from that many threads and prints p50/p99 latency (time to
the whole answer; with --stream, also to the first token), generated tokens/s over the round, how many were refused
(429), and whether the server still answers /v1/models. With several counts, each round is compared with the
first: its tokens/s and p50 latency as multiples of the first round's (issue 25's target for 8 clients against 1:
>= 3x the tokens/s, <= 2x the p50). With --decode-step, no server: the batcher's step is timed in this process
with each count of rows generating (what batching gains when HTTP and a loaded host's scheduling are left out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


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
    p.add_argument("--clients", default="4", help="concurrent clients; a list (1,8) runs a round for each")
    p.add_argument("--requests", type=int, default=64, help="completions sent in each round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--stream", action="store_true", help="stream, and time the first token too")
    p.add_argument("--queue", type=int, help="the server's --queue (default: the most clients, so none is refused)")
    p.add_argument("--parallel", help="the server's --parallel")
    p.add_argument("--threads", help="the server's --threads")
    p.add_argument("--json", help="also write the rounds' figures to this file")
    p.add_argument("--decode-step", action="store_true", help="time the batcher's step in this process instead")
    args = p.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    if args.decode_step:
        decode_steps(args, counts)
        return
    flags = tuple(
        f for name in ("threads", "parallel") if getattr(args, name) for f in (f"--{name}", getattr(args, name))
    )
    server, url = start_server(args.path, max(counts) if args.queue is None else args.queue, flags)
    try:
        model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=60))["data"][0]["id"]
        body = {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 1.0}
        body |= {"stream": True, "stream_options": {"include_usage": True}} if args.stream else {}
        post(url, body | {"max_tokens": 4})  # loads the checkpoint: not part of the figures
        rounds = [one_round(url, body, clients, args) for clients in counts]
    finally:
        server.terminate()
        server.wait(timeout=30)
    for r in rounds[1:]:
        r["tokens_per_s_vs_first"] = r["tokens_per_s"] / rounds[0]["tokens_per_s"]
        r["p50_vs_first"] = r["p50_s"] / rounds[0]["p50_s"]
        print(
            f"{r['clients']} clients against {rounds[0]['clients']}: {r['tokens_per_s_vs_first']:.2f}x the tokens/s, "
            f"p50 latency {r['p50_vs_first']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"flags": list(flags), "rounds": rounds}, indent=1) + "\n")


def decode_steps(args: argparse.Namespace, counts: list[int]) -> None:
    """The batcher's decode step in this process, no HTTP or client threads: ms a step with each count of rows
    generating (3 rounds of --max-tokens; min and median), as on a loaded host the wall-clock rounds mostly
    measure the scheduler."""
    import torch

    from gptforge.checkpoint import load_for_inference
    from gptforge.serve.batcher import Batcher
    from gptforge.serve.jobs import Job, Started
    from gptforge.serve.protocol import Limits, parse_completion

    if args.threads:
        torch.set_num_threads(int(args.threads))
    run = load_for_inference(args.path)
    body = {"model": "m", "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 1.0}
    rounds = []
    for rows in counts:
        times = []
        for _ in range(3):
            batcher = Batcher(rows, threading.Event())
            for seed in range(rows):
                job = Job(parse_completion(body | {"seed": seed}, Limits()), lambda event: None, time.monotonic() + 600)
                batcher.submit(job, run, [run.tokenizer.encode(args.prompt)], Started("m", "m"), end=lambda last: None)
            batcher.step()  # the prefills
            while batcher.generating == rows:
                t0 = time.perf_counter()
                batcher.step()
                times.append(time.perf_counter() - t0)
        ms = {"rows": rows, "min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}
        rounds.append(ms | {"load_average": os.getloadavg()[0], "threads": torch.get_num_threads()})
        print(f"{rows} rows: {ms['min_ms']:.2f} ms a step at best, median {ms['median_ms']:.2f} ms")
    first = rounds[0]
    for r in rounds[1:]:
        for stat in ("min", "median"):  # k rows make k tokens a step
            r[f"tokens_per_s_vs_first_{stat}"] = r["rows"] / first["rows"] * first[f"{stat}_ms"] / r[f"{stat}_ms"]
        print(
            f"{r['rows']} rows against {first['rows']}: {r['tokens_per_s_vs_first_median']:.2f}x the tokens/s "
            f"(at best {r['tokens_per_s_vs_first_min']:.2f}x), a step {r['median_ms'] / first['median_ms']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"decode_step": rounds}, indent=1) + "\n")


def one_round(url: str, body: dict, clients: int, args: argparse.Namespace) -> dict:
    """`args.requests` completions from `clients` threads, each request its own seed; the round's figures."""
    seeds = iter(range(args.requests))
    lock = threading.Lock()

    def one(_: int) -> tuple[float, float, int, int]:
        with lock:
            seed = next(seeds)
        return post(url, body | {"seed": seed})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(args.requests)))
    return report(args, clients, results, time.perf_counter() - t0, url)


def report(
    args: argparse.Namespace, clients: int, results: list[tuple[float, float, int, int]], wall: float, url: str
) -> dict:
    ok = [r for r in results if r[3] == 200]
    latency = [r[0] for r in ok]
    tokens = sum(r[2] for r in ok)
    figures = {
        "clients": clients,
        "requests": args.requests,
        "answered": len(ok),
        "refused": sum(r[3] == 429 for r in results),
        "errors": sum(r[3] not in (200, 429) for r in results),
        "p50_s": statistics.median(latency),
        "p99_s": percentile(latency, 99),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "load_average": os.getloadavg()[0],  # a shared host's other work shows in every figure: say how much
    }
    print(f"{args.requests} requests from {clients} clients, max_tokens {args.max_tokens}, in {wall:.1f} s")
    print(f"load average (1 min) at the round's end: {figures['load_average']:.2f} on {os.cpu_count()} CPUs")
    print(f"answered {len(ok)}, refused (429) {figures['refused']}, other errors {figures['errors']}")
    print(f"latency p50 {figures['p50_s']:.3f} s, p99 {figures['p99_s']:.3f} s")
    if args.stream:
        first = [r[1] for r in ok]
        figures |= {"first_token_p50_s": statistics.median(first), "first_token_p99_s": percentile(first, 99)}
        print(f"first token p50 {figures['first_token_p50_s']:.3f} s, p99 {figures['first_token_p99_s']:.3f} s")
    print(f"generated {tokens} tokens: {figures['tokens_per_s']:.1f} tokens/s")
    alive = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=60))["data"]
    print(f"afterwards /v1/models answers: {[m['id'] for m in alive]}")
    return figures


if __name__ == "__main__":
    main()
