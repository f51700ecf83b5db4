"""`gptforge serve` in a subprocess, for the tests that talk to it over HTTP."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import subprocess
import threading

from tests.helpers import cli


@contextlib.contextmanager
def serving(path, *flags, log=None):
    """`gptforge serve PATH --port 0 --threads 1 FLAGS` in a subprocess; yields its base URL (http://127.0.0.1:PORT).
    One thread: the tests' machine runs other work beside it (see the guide's CPU performance note)."""
    with server_process(path, *flags, log=log) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(path, *flags, log=None, sigint_ignored=False):
    """serving(), yielding the base URL and the server's Popen; `sigint_ignored`: started as a script's background
    job is (`cmd &` without job control), SIGINT ignored from the start, which Python then never turns into
    KeyboardInterrupt."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    with open(log, "w") if log else contextlib.nullcontext(subprocess.DEVNULL) as err:
        server = subprocess.Popen(
            cli("serve", path, "--port", "0", "--threads", "1", *flags),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            preexec_fn=ignore,
        )
        try:
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=lambda: lines.put(server.stdout.readline()), daemon=True).start()
            first = lines.get(timeout=120)
            url = re.search(r"http://127\.0\.0\.1:\d+", first)
            assert url, f"no address in {first!r} (exit code {server.poll()})"
            yield url.group(0), server
        finally:
            server.terminate()
            server.wait(timeout=30)
