"""Tasks from a file: our form and HumanEval's, every bad row one line naming file:line."""

import json

import pytest

from gptforge.errors import GptforgeError
from gptforge.eval.humaneval import run_programs
from gptforge.tasks.read import read_tasks

OURS = {"request": "Write `double(x)` returning 2 * x.", "entry_point": "double", "tests": ["assert double(2) == 4"]}
HUMANEVAL = {
    "task_id": "HumanEval/x",
    "prompt": 'def inc(x):\n    """x plus one"""\n',
    "test": "def check(candidate):\n    assert candidate(1) == 2\n",
    "entry_point": "inc",
}


def write(tmp_path, *rows):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_both_forms_read_and_humaneval_s_test_runs_its_check(tmp_path):
    path = write(tmp_path, OURS, {**OURS, "family": "maths", "name": "n1"}, HUMANEVAL)
    ours, named, humaneval = read_tasks(path)
    expected = (f"{path}:1", "file", "double", tuple(OURS["tests"]))  # unnamed: named by where it is
    assert (ours.name, ours.family, ours.entry_point, ours.tests) == expected
    assert (named.name, named.family) == ("n1", "maths")
    assert humaneval.name == "HumanEval/x" and humaneval.family == "humaneval" and "def inc(x):" in humaneval.request
    right, wrong = "def inc(x):\n    return x + 1\n", "def inc(x):\n    return x\n"
    programs = [code + "\n" + humaneval.tests[0] + "\n" for code in (right, wrong)]
    assert [ok for ok, _ in run_programs(programs)] == [True, False]  # check(inc) is called, not only defined


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ([1, 2], "expected a task"),
        ({"request": "x"}, "expected a task"),
        ({**OURS, "tests": []}, "tests: list, empty"),
        ({**OURS, "tests": "assert 1"}, "tests: str"),
        ({**OURS, "tests": ["assert 1", 5]}, "'tests\\[1\\]' must be non-empty text"),
        ({**OURS, "request": "  "}, "'request' must be non-empty text"),
        ({**OURS, "entry_point": "not a name"}, "entry_point 'not a name' is not a Python function name"),
        ({**OURS, "entry_point": "def"}, "entry_point 'def' is not a Python function name"),
        ({**OURS, "request": "\ud800"}, "'request' is not valid UTF-8 text"),
        ({**HUMANEVAL, "test": None}, "'test' must be non-empty text"),
    ],
)
def test_a_bad_row_is_one_line_naming_its_line(tmp_path, row, says):
    with pytest.raises(GptforgeError, match=rf"t\.jsonl:2: .*{says}"):
        read_tasks(write(tmp_path, OURS, row))


def test_an_empty_file_or_a_fifo_is_refused(tmp_path):
    import os

    with pytest.raises(GptforgeError, match="--tasks .*t.jsonl: no tasks"):
        read_tasks(write(tmp_path))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(GptforgeError, match="not a regular file"):
        read_tasks(tmp_path / "fifo")
