"""A reply's score on its task: its answer's code runs against the task's tests in the sandbox, one process per
reply (time, memory and file-size limits, no network, no processes, no writes outside a throwaway folder), and
only the harness's nonce-marked lines count. What the sandbox refuses, a timeout or a memory blow-up scores 0."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gptforge.runtime.sandbox import REFUSAL_MARK
from gptforge.tasks.builtin import Task
from gptforge.tasks.reply import answer

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
    with tempfile.TemporaryDirectory(prefix="gptforge-task-") as tmp:
        Path(tmp, "task.json").write_text(json.dumps({"code": found.code, "tests": list(task.tests)}), "utf-8")
        nonce = secrets.token_hex(16)
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        limits = [str(memory_bytes), str(int(timeout) + 1)]  # CPU seconds: a backstop behind the wall clock
        env = {"PATH": os.environ.get("PATH", ""), "HOME": tmp, "TMPDIR": tmp}
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(SANDBOX), str(HARNESS), *limits],
                cwd=tmp,
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
        lines = _marked(out, nonce)
        refused = _refusal(err)
    if refused:
        return Score(True, True, 0, tests, False, refused)
    if "memory" in lines or "done" not in lines:
        why = "out of memory" if "memory" in lines else f"ended early (exit code {proc.returncode})"
        return Score(True, True, 0, tests, False, why)
    passed = sum(f"{i} pass" in lines for i in range(tests))
    return Score(True, True, passed, tests, True, "" if passed == tests else f"{tests - passed} of {tests} failed")


def score_replies(
    tasks: list[Task], replies: list[str], workers: int | None = None, timeout: float = 5.0
) -> list[Score]:
    """score_reply for each (task, reply) pair, `workers` processes at a time (default: one per CPU), in order."""
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda pair: score_reply(*pair, timeout=timeout), zip(tasks, replies, strict=True)))


def _marked(path: Path, nonce: str) -> set[str]:
    """What the harness said: the lines that start with the nonce, without it."""
    prefix = f"{nonce} ".encode()
    with path.open("rb") as f:
        return {line[len(prefix) :].decode().strip() for line in f if line.startswith(prefix)}


def _refusal(path: Path) -> str:
    """The sandbox's first refusal, if any, from the reply's stderr."""
    with path.open("rb") as f:
        for line in f:
            text = line.decode(errors="replace")
            if text.startswith(REFUSAL_MARK):
                return text[len(REFUSAL_MARK) :].strip()
    return ""
