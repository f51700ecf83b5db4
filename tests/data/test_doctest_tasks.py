"""Tasks mined from doctests: a function's literal examples become its hidden tests, its docstring without them the
request; only what its own function passes alone is kept; each task takes its file's split."""

import pytest

from gptforge.data.chat.doctests import doctest_tasks
from gptforge.data.pipeline import is_validation
from gptforge.errors import GptforgeError
from gptforge.eval.tasks import load_tasks

MODULE = '''import math


def hyp(a, b):
    """The hypotenuse of a right triangle.

    >>> hyp(3, 4)
    5.0
    >>> hyp(a=5, b=12)
    13.0
    >>> hyp(**{'a': 3, 'b': 4})
    5.0
    >>> x = 3
    >>> hyp(x, 4)
    5.0

    Sides are not checked.
    """
    return math.sqrt(a * a + b * b)


def helped(s):
    """Uses the module's helper.

    >>> helped('ab')
    'ba'
    """
    return _flip(s)


def _flip(s):
    return s[::-1]


def wrong(n):
    """Its example is wrong.

    >>> wrong(2)
    5
    """
    return n + 1


def words(s):
    """Splits on spaces.

    >>> words('a b')
    ['a', 'b']
    >>> words('')
    []
    >>> len(words('a'))
    1
    """
    return s.split()


class K:
    def method(self, x):
        """A method is not mined.

        >>> K().method(1)
        1
        """
        return x
'''


def test_literal_examples_become_tests_and_the_docstring_without_them_the_request():
    tasks = doctest_tasks([("a.py", MODULE)], "val")  # the first file is always a validation file
    assert [t.name for t in tasks] == ["a.py:hyp", "a.py:words"]  # `helped` needs the module, `wrong` fails itself
    hyp, words = tasks
    assert hyp.tests == ("assert hyp(3, 4) == 5.0", "assert hyp(a=5, b=12) == 13.0")
    assert hyp.request == (
        "Write a Python function `hyp(a, b)`.\nThe hypotenuse of a right triangle.\n\nSides are not checked."
    )
    assert hyp.entry_point == "hyp" and hyp.family == "doctest" and hyp.solution.startswith("import math\n")
    assert words.tests == ("assert words('a b') == ['a', 'b']", "assert words('') == []")
    assert ">>>" not in words.request and "[]" not in words.request


def test_each_task_takes_its_file_s_split_as_prepare_holds_files_out():
    files = [(f"m{i}.py", MODULE.replace("def hyp", f"def hyp{i}").replace("hyp(", f"hyp{i}(")) for i in range(12)]
    held = {f"m{i}.py" for i, (name, _) in enumerate(files) if is_validation(name, i, 0.02)}
    val = doctest_tasks(files, "val")
    train = doctest_tasks(files, "train")
    assert 0 < len(held) < 12
    assert {t.name.split(":")[0] for t in val} == held
    assert {t.name.split(":")[0] for t in train} == {name for name, _ in files} - held


def test_eval_and_rl_load_mined_tasks_and_a_corpus_without_any_is_one_line(tmp_path):
    (tmp_path / "a.py").write_text(MODULE)
    assert [t.name for t in load_tasks(f"doctests:{tmp_path}")] == ["a.py:hyp", "a.py:words"]
    with pytest.raises(GptforgeError, match=r"^rl.tasks doctests:.*: no train task \(no function of "):
        load_tasks(f"doctests:{tmp_path}", flag="rl.tasks", split="train")
    with pytest.raises(GptforgeError, match="no such file or directory"):
        load_tasks(f"doctests:{tmp_path / 'missing'}")


def test_a_file_nested_past_the_parser_s_depth_is_skipped_and_an_empty_corpus_is_one_line(tmp_path):
    from gptforge.data.chat.instructions import defines_function, function_tasks
    from gptforge.tasks.reply import answer

    deep = "x = " + "-" * 100_000 + "1\n"
    assert doctest_tasks([("deep.py", deep), ("a.py", MODULE)], "train") != []  # a.py, the second file, trains
    assert list(function_tasks([("deep.py", deep)])) == []
    assert not defines_function(deep, "x") and not answer(deep, "x").parses
    with pytest.raises(GptforgeError, match=r"^--tasks doctests:: no corpus named"):
        load_tasks("doctests:")
