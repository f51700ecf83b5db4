"""README's "Train on your own corpus": its commands, run as written on a small corpus (a tiny model, a few steps)."""

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import write_corpus

from gptforge.cli import main

README = Path(__file__).parents[1] / "README.md"
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=64", "train.micro_batch=2"]
TINY += ["train.batch_tokens=128", "train.max_steps=3", "train.time_budget=0", "eval.tokens=512", "eval.every=0"]


def walkthrough() -> list[list[str]]:
    """The section's commands, comments and a trailing & removed."""
    section = README.read_text().split("## Train on your own corpus", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip().removesuffix("&").strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("uvicorn")
    monkeypatch.chdir(tmp_path)
    write_corpus(Path("my_corpus"), 500)  # 1% held out: 5 files, enough for a validation batch
    commands = walkthrough()
    assert [c[:2] for c in commands] == [
        ["gptforge", name] for name in ("prepare", "train", "serve", "sample", "eval", "export", "export")
    ]
    server = None
    try:
        for command in commands:
            args = command[1:]
            if args[0] == "train":
                args += [a for kv in TINY for a in ("--set", kv)]
            if args[0] == "serve":  # in the background, as the README runs it; a free port instead of 8000
                args[args.index("--port") + 1] = "0"
                code = "import sys; from gptforge.cli import main; sys.exit(main(sys.argv[1:]))"
                server = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
                address = re.search(r"http://\S+", server.stdout.readline()).group(0).rstrip("/")
                models = json.loads(urllib.request.urlopen(f"{address}/v1/models", timeout=30).read())
                assert [m["id"] for m in models["data"]] == ["mine"]
                assert b"<html" in urllib.request.urlopen(address, timeout=30).read().lower()
                continue
            assert main(args) == 0, args
        out = capsys.readouterr().out
        assert "def parse_args(" in out and "removed:" in out and "val" in out
        assert (tmp_path / "data/mine/report.md").is_file() and (tmp_path / "hf/mine/config.json").is_file()
        assert (tmp_path / "mine.gguf").read_bytes()[:4] == b"GGUF"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
