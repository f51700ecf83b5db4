"""README's "Train on your own corpus": its commands, run as written on a small corpus (a tiny model, a few steps), in
the environment its own lines make: `gptforge` found on PATH as activation puts it, and only the extras its `pip`
line installs importable (every other optional library made unimportable, as tests/test_demo.py does for `make demo`).
"""

import glob
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tests.conftest import write_corpus

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=64", "train.micro_batch=2"]
TINY += ["train.batch_tokens=128", "train.max_steps=3", "train.time_budget=0", "eval.tokens=512", "eval.every=0"]
SEEDED = {"pip", "setuptools"}  # what `python3 -m venv` puts in every environment it makes
# The console script, run as the shell would run it, once per command, with the libraries outside the environment
# made unimportable: None in sys.modules fails their import and find_spec finds nothing.
RUN = """
import json, runpy, sys
sys.modules.update(dict.fromkeys(json.loads(sys.argv[1])))
script = sys.argv[2]
for args in json.loads(sys.argv[3]):
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code:
            sys.exit(f"{args} exited with {e.code}")
"""


def walkthrough(heading: str = "## Train on your own corpus") -> list[tuple[list[str], bool]]:
    """The section's commands, comments removed, each with whether it runs in the background (a trailing &); a
    word with a '*' is expanded as the shell would (in the current folder)."""
    section = README.read_text().split(heading, 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    expand = lambda word: sorted(glob.glob(word)) or [word] if "*" in word else [word]  # noqa: E731
    commands = [shlex.split(line.removesuffix("&")) for line in lines if line]
    return [
        ([w for word in c for w in expand(word)], line.endswith("&"))
        for c, line in zip(commands, [x for x in lines if x], strict=True)
    ]


def installed(extras: set[str]) -> set[str]:
    """The distributions `pip install -e '.[EXTRAS]'` leaves in a fresh venv: gptforge's requirements for those
    extras, theirs, and so on."""
    seen, todo = set(), [("gptforge", frozenset(extras))] + [(name, frozenset()) for name in SEEDED]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:  # a requirement of another platform or Python
            continue
        for requirement in map(Requirement, requires):
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in {"", *wanted}):
                todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return {name for name, _ in seen}


def unimportable(extras: set[str]) -> list[str]:
    """The top-level modules of this environment that a fresh venv with gptforge[EXTRAS] would not have."""
    keep = installed(extras)
    return sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not keep & {canonicalize_name(d) for d in dists} and module not in sys.stdlib_module_names
    )


def environment(setup: list[list[str]]) -> tuple[dict[str, str], set[str]]:
    """The README's set-up lines (activate the venv, pip install the extras), run from the checkout: the environment
    variables activation sets (this interpreter's own folder taken off PATH first) and the extras installed."""
    (dot, activate), (pip, install, editable, target) = setup
    assert dot == "." and (pip, install, editable) == ("pip", "install", "-e"), setup
    venv_bin = (ROOT / activate).parent
    others = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) not in (venv_bin, Path(sys.executable).parent)]
    env = {**os.environ, "PATH": os.pathsep.join([str(venv_bin), *others]), "VIRTUAL_ENV": str(venv_bin.parent)}
    return env, set(re.fullmatch(r"\.\[([\w,-]+)\]", target).group(1).split(","))


def run_in(env: dict[str, str], blocked: list[str], commands: list[list[str]], **popen) -> subprocess.Popen:
    """The commands, one after another, by the `gptforge` that PATH finds, run by the interpreter its #! names."""
    script = shutil.which(commands[0][0], path=env["PATH"])
    assert script, f"{commands[0][0]} is not on PATH after the README's set-up lines"
    interpreter = Path(script).read_text().split("\n", 1)[0].removeprefix("#!")
    args = [json.dumps(blocked), script, json.dumps([c[1:] for c in commands])]
    return subprocess.Popen([interpreter, "-c", RUN, *args], env=env, text=True, **popen)


def finished(process: subprocess.Popen) -> str:
    """What a command run by `run_in` printed, once it succeeded."""
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]
    return out


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("uvicorn")
    monkeypatch.chdir(tmp_path)
    # where the README's corpus is in a checkout's .venv
    corpus = write_corpus(Path(f".venv/lib/python3.{sys.version_info.minor}/site-packages/pip"), 500)
    lines = walkthrough()
    assert lines[2][0][2] == str(corpus)  # the shell's expansion of its python3.* finds it
    assert [(c[:2], background) for c, background in lines[2:]] == [
        (["gptforge", name], name == "serve")
        for name in ("prepare", "train", "serve", "sample", "eval", "export", "export")
    ]
    env, extras = environment([c for c, _ in lines[:2]])
    blocked = unimportable(extras)
    assert {"transformers", "pytest"} <= set(blocked)  # the dev environment's other libraries are out of reach
    (prepare, _), (train, _), (serve, _), *rest = lines[2:]
    train += [a for kv in TINY for a in ("--set", kv)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    printed = finished(run_in(env, blocked, [prepare, train, *[command for command, _ in rest]], **pipes))
    serve[serve.index("--port") + 1] = "0"  # a free port instead of 8000
    server = run_in(env, blocked, [serve], **pipes)
    try:
        found = re.search(r"http://\S+", server.stdout.readline())
        assert found, server.communicate(timeout=30)[1][-3000:]
        address = found.group(0).rstrip("/")
        models = json.loads(urllib.request.urlopen(f"{address}/v1/models", timeout=30).read())
        assert [m["id"] for m in models["data"]] == ["mine"]
        assert b"<html" in urllib.request.urlopen(address, timeout=30).read().lower()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "def parse_args(" in printed and "removed:" in printed and "val" in printed
    assert (tmp_path / "data/mine/report.md").is_file() and (tmp_path / "hf/mine/config.json").is_file()
    assert (tmp_path / "mine.gguf").read_bytes()[:4] == b"GGUF"

    # the chat section: its conversations are what `demo --chat` writes, here from the same small corpus
    from gptforge.data.chat.instructions import conversation_rows
    from gptforge.files import to_json

    documents = ((p.name, p.read_text()) for p in sorted(corpus.glob("*.py")))
    rows = "".join(to_json(row) + "\n" for row in conversation_rows(documents, 0.2))
    (tmp_path / "data/stdlib-chat.jsonl").write_text(rows)
    chat = walkthrough("## From a base model to a chat model")
    assert [c[:2] for c, _ in chat] == [["gptforge", name] for name in ("demo", "prepare", "train", "chat", "export")]
    (demo, _), (prepare, _), (train, _), (talk, _), (export, _) = chat  # demo trains on the stdlib; chat waits
    train += [a for kv in TINY if not kv.startswith("model.") for a in ("--set", kv)]  # the base's model
    printed = finished(run_in(env, blocked, [prepare, train, export], **pipes))
    assert "training conversations" in printed and (tmp_path / "hf/chat/tokenizer.json").is_file()
