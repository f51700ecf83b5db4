"""Tasks from a JSONL file: our form ({"request", "entry_point", "tests"}) or HumanEval's ({"task_id", "prompt",
"test", "entry_point"}, its prompt asked for as a whole function). A bad row is one line naming file:line."""

from __future__ import annotations

import keyword
import re
from pathlib import Path
from typing import Any

from gptforge.errors import GptforgeError
from gptforge.inputs import not_utf8, read_jsonl, require_regular_file
from gptforge.tasks.builtin import Task

IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def read_tasks(path: str | Path, flag: str = "--tasks") -> list[Task]:
    """Every task of the file, in order; an empty file is refused."""
    require_regular_file(path, flag)
    tasks = [_task(row, where) for where, row in read_jsonl(path)]
    if not tasks:
        raise GptforgeError(f"{flag} {path}: no tasks (expected JSON lines with request, entry_point and tests)")
    return tasks


def _task(row: Any, where: str) -> Task:
    if isinstance(row, dict) and {"prompt", "test", "entry_point"} <= row.keys():  # HumanEval's form
        _check_texts(row, ("prompt", "test", "entry_point"), where)
        entry = _entry_point(row["entry_point"], where)
        request = f"Write the complete Python function `{entry}`:\n\n{row['prompt'].rstrip()}\n"
        name = row.get("task_id") if isinstance(row.get("task_id"), str) else where
        return Task(name, "humaneval", request, entry, (f"{row['test']}\ncheck({entry})",), "")
    expected = f"{where}: expected a task: request text, entry_point a function name, tests a list of texts"
    if not isinstance(row, dict) or not {"request", "entry_point", "tests"} <= row.keys():
        raise GptforgeError(f"{expected} (it has {sorted(row)[:5] if isinstance(row, dict) else type(row).__name__})")
    tests = row["tests"]
    if not isinstance(tests, list) or not tests:
        raise GptforgeError(f"{expected} (tests: {type(tests).__name__}{'' if tests else ', empty'})")
    _check_texts(row, ("request", "entry_point"), where)
    _check_texts({f"tests[{i}]": t for i, t in enumerate(tests)}, [f"tests[{i}]" for i in range(len(tests))], where)
    family = row.get("family") if isinstance(row.get("family"), str) else "file"
    name = row.get("name") if isinstance(row.get("name"), str) else where
    return Task(name, family, row["request"], _entry_point(row["entry_point"], where), tuple(tests), "")


def _check_texts(row: dict, keys: Any, where: str) -> None:
    for key in keys:
        value = row[key]
        if not isinstance(value, str) or not value.strip():
            raise GptforgeError(f"{where}: '{key}' must be non-empty text, not {type(value).__name__} {value!r:.40}")
        bad = not_utf8(value)
        if bad:
            raise GptforgeError(f"{where}: '{key}' is {bad}")


def _entry_point(name: str, where: str) -> str:
    if not IDENTIFIER.fullmatch(name) or keyword.iskeyword(name):
        raise GptforgeError(f"{where}: entry_point {name!r:.40} is not a Python function name")
    return name
