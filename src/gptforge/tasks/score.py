"""A reply's score on its task: its answer's code runs against the task's tests in the sandbox, one process per
reply (time, memory and file-size limits, no network, no processes, no writes outside a throwaway folder), and
only the harness's nonce-marked lines count. An `assert CALL == LITERAL` test (either side) is judged here: the
reply's process gets the call alone and reports the value, compared with exact types at every level. What the
sandbox refuses, a timeout or a memory blow-up scores 0."""

from __future__ import annotations

import ast
import json
import os
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gptforge.runtime.sandbox import HIDDEN, REFUSAL_MARK
from gptforge.tasks.builtin import Task
from gptforge.tasks.reply import answer, parsed

SANDBOX = Path(__file__).parents[1] / "runtime" / "sandbox.py"
HARNESS = Path(__file__).with_name("harness.py")
# What a reply earns: "pass" 1 when every test passes, else 0; "share" the share of its tests that pass (a
# denser signal for a weak policy, which may also reward answers that handle only the easy cases).
REWARDS = ("pass", "share")


@dataclass(frozen=True)
class Score:
    """What one reply did: whether its answer parses and defines the function, how many tests it passed, and
    whether it ran within the sandbox's rules (else `why`)."""

    parses: bool
    defines: bool
    passed: int
    tests: int
    clean: bool
    why: str = ""

    @property
    def solved(self) -> bool:
        return self.clean and self.passed == self.tests

    def reward(self, rule: str) -> float:
        if rule not in REWARDS:
            raise ValueError(f"reward={rule!r}: expected one of {', '.join(REWARDS)}")
        if rule == "pass":
            return float(self.solved)
        return self.passed / self.tests if self.clean else 0.0


def score_reply(task: Task, reply: str, timeout: float = 5.0, memory_bytes: int = 512 << 20) -> Score:
    """Run `reply`'s answer against `task`'s tests; a reply that does not parse or define the function runs not."""
    found, tests = answer(reply, task.entry_point), len(task.tests)
    if not found.parses or not found.defines:
        why = "does not parse" if not found.parses else f"defines no {task.entry_point}"
        return Score(found.parses, found.defines, 0, tests, True, why)
    judged = [compare(test) for test in task.tests]
    calls = [[i, parts[0]] for i, parts in enumerate(judged) if parts is not None]
    statements = [[i, test] for i, (test, parts) in enumerate(zip(task.tests, judged, strict=True)) if parts is None]
    with tempfile.TemporaryDirectory(prefix="gptforge-task-") as tmp:
        # Its output lands beside its folder, in one it may not open.
        work, said_dir = Path(tmp, "work"), Path(tmp, "said")
        out, err = said_dir / "stdout", said_dir / "stderr"
        work.mkdir()
        said_dir.mkdir()
        code = {"code": found.code, "calls": calls, "statements": statements}
        Path(work, "task.json").write_text(json.dumps(code), "utf-8")
        nonce = secrets.token_hex(16)
        limits = [str(memory_bytes), str(int(timeout) + 1)]  # CPU seconds: a backstop behind the wall clock
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(work), "TMPDIR": str(work), HIDDEN: str(said_dir)}
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(SANDBOX), str(HARNESS), *limits],
                cwd=work,
                env=env,
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
            try:
                proc.communicate(f"{nonce}\n".encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # its whole session: nothing it started outlives it
                proc.wait()
                return Score(True, True, 0, tests, False, "timed out")
        said = _marked(out, nonce)
        refused = _refusal(err)
    if refused:
        return Score(True, True, 0, tests, False, refused)
    if "memory" in said or "done" not in said:
        why = "out of memory" if "memory" in said else f"ended early (exit code {proc.returncode})"
        return Score(True, True, 0, tests, False, why)
    passed = sum(_passed(said.get(str(i), ""), parts) for i, parts in enumerate(judged))
    return Score(True, True, passed, tests, True, "" if passed == tests else f"{tests - passed} of {tests} failed")


def compare(test: str) -> tuple[str, object] | None:
    """(the call's source, the literal it must equal) for `assert CALL == LITERAL` or `assert LITERAL == CALL`;
    None for any other test."""
    tree = parsed(test)
    if tree is None:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    check = tree.body[0].test
    if not isinstance(check, ast.Compare) or len(check.ops) != 1 or not isinstance(check.ops[0], ast.Eq):
        return None
    for call, literal in ((check.left, check.comparators[0]), (check.comparators[0], check.left)):
        try:
            return ast.unparse(call), ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return None


def same(got: object, want: object) -> bool:
    """`got == want` for the builtin values a literal can hold, the types exact at every level: set members and
    dict keys too (`{True}` is not `{1}`), and a zero's sign (`-0.0` is not `0.0`)."""
    kind = type(want)
    if type(got) is not kind:
        return False
    if kind in (list, tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if kind in (set, frozenset):
        return {_typed(g) for g in got} == {_typed(w) for w in want}
    if kind is dict:
        keys = {_typed(k): k for k in got}
        return len(got) == len(want) and all(
            _typed(k) in keys and same(got[keys[_typed(k)]], v) for k, v in want.items()
        )
    return _typed(got) == _typed(want)


def _typed(value: object) -> object:
    """A hashable value's stand-in that tells apart what `==` equates: types at every level, a zero's sign."""
    if isinstance(value, tuple | frozenset):
        return type(value), type(value)(map(_typed, value))
    if isinstance(value, float | complex):
        return type(value), value, str(value)  # the text keeps -0.0 apart from 0.0
    return type(value), value


def _passed(line: str, parts: tuple[str, object] | None) -> bool:
    """Whether the harness's first line about a test says it passed: "pass", or a value equal to the literal."""
    if parts is None:
        return line == "pass"
    if not line.startswith("value "):
        return False
    try:
        got = ast.literal_eval(line.removeprefix("value "))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return same(got, parts[1])


def score_replies(
    tasks: list[Task], replies: list[str], workers: int | None = None, timeout: float = 5.0
) -> list[Score]:
    """score_reply for each (task, reply) pair, `workers` processes at a time (default: one per CPU), in order."""
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda pair: score_reply(*pair, timeout=timeout), zip(tasks, replies, strict=True)))


def _marked(path: Path, nonce: str) -> dict[str, str]:
    """What the harness said: "done" and "memory" as themselves, each test's first line by its index."""
    prefix, said = f"{nonce} ".encode(), {}
    with path.open("rb") as f:
        for line in f:
            if line.startswith(prefix):
                what = line[len(prefix) :].decode(errors="replace").strip()
                key, _, rest = what.partition(" ")
                said.setdefault(key, rest if rest else key)
    return said


def _refusal(path: Path) -> str:
    """The sandbox's first refusal, if any, from the reply's stderr."""
    with path.open("rb") as f:
        for line in f:
            text = line.decode(errors="replace")
            if text.startswith(REFUSAL_MARK):
                return text[len(REFUSAL_MARK) :].strip()
    return ""
