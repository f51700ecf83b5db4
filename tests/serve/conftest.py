"""A folder of two tiny runs, trained once per session, and `gptforge serve` started on it in a subprocess."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import shutil
import subprocess
import threading

import pytest

from gptforge.config import load_config
from gptforge.train.trainer import train
from tests.helpers import cli

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory, data_dir):
    """runs/alpha: 4 steps, checkpoints at 2 and 4, evaluation and samples every 2; runs/beta: its copy with
    higher losses, so the page has a second run to overlay."""
    root = tmp_path_factory.mktemp("runs")
    overrides = [f"data.path={data_dir}", "train.max_steps=4", "eval.every=2", "checkpoint.every=2"]
    train(load_config("tiny", overrides), root / "alpha")
    shutil.copytree(root / "alpha", root / "beta")
    records = [json.loads(line) for line in (root / "beta" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if isinstance(r.get("loss"), float):
            r["loss"] += 0.5
    (root / "beta" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@contextlib.contextmanager
def serving(path, *flags, log=None):
    """`gptforge serve PATH --port 0 FLAGS` in a subprocess; yields its base URL (http://127.0.0.1:PORT)."""
    with open(log, "w") if log else contextlib.nullcontext(subprocess.DEVNULL) as err:
        server = subprocess.Popen(
            cli("serve", path, "--port", "0", *flags), stdout=subprocess.PIPE, stderr=err, text=True
        )
        try:
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=lambda: lines.put(server.stdout.readline()), daemon=True).start()
            first = lines.get(timeout=120)
            url = re.search(r"http://127\.0\.0\.1:\d+", first)
            assert url, f"no address in {first!r} (exit code {server.poll()})"
            yield url.group(0)
        finally:
            server.terminate()
            server.wait(timeout=30)
