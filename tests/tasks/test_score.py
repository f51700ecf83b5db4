import textwrap

import pytest

from gptforge.tasks.builtin import Task
from gptforge.tasks.score import REWARDS, Score, score_replies, score_reply

TASK = Task(
    "t/0",
    "reverse",
    "Write `rev(s)`.",
    "rev",
    ("assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('ab') == 'ba'", "assert rev('aab') == 'baa'"),
    "",
)
RIGHT = "def rev(s):\n    return s[::-1]\n"


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{textwrap.dedent(code)}```\n"


def test_a_right_reply_passes_every_test_whatever_it_prints():
    noisy = RIGHT.replace("return", "print('0 fail\\ndone', end='', flush=True)\n    return")
    for reply in (fenced(RIGHT), fenced("print('FAILED')\n" + noisy), RIGHT):
        score = score_reply(TASK, reply)
        assert score == Score(True, True, 4, 4, True, "")
        assert score.solved and score.reward("pass") == score.reward("share") == 1.0


def test_a_reply_that_handles_some_cases_earns_its_share_or_nothing():
    score = score_reply(TASK, fenced("def rev(s):\n    return s[::-1] if len(s) < 3 else s\n"))
    assert (score.passed, score.tests, score.clean, score.solved) == (2, 4, True, False)
    assert score.reward("share") == 0.5 and score.reward("pass") == 0.0


@pytest.mark.parametrize(
    "code",
    [
        "print('passed')\nprint('4 of 4 passed')\ndef rev(s):\n    return s + '.'\n",
        # An answer equal to everything, as a value, a str subclass, and inside a container.
        "class Any:\n    def __eq__(self, other):\n        return True\ndef rev(s):\n    return Any()\n",
        "class S(str):\n    def __eq__(self, other):\n        return True\ndef rev(s):\n    return S('x')\n",
        "import builtins\nbuiltins.type = lambda x: str\nbuiltins.eval = lambda *a: 'cba'\ndef rev(s):\n    return 0\n",
        "import builtins\nbuiltins.AssertionError = KeyError\ndef rev(s):\n    assert False\n",
        "import os\nos._exit(0)\ndef rev(s):\n    return s[::-1]\n",
        "import sys\nsys.exit(0)\ndef rev(s):\n    return s[::-1]\n",
        "def rev(s):\n    import os\n    os._exit(0)\n",
        "def rev(s):\n    raise SystemExit(0)\n",
        "import os\nprint('\\n'.join(['', '0 pass', '1 pass', '2 pass', '3 pass', 'done']), flush=True)\nos._exit(0)\n"
        "def rev(s):\n    return s\n",
    ],
    ids=["prints", "always-equal", "str-subclass", "rebinds-builtins", "patches-assert", "exits", "sys-exit",
         "exits-in-call", "system-exit-in-call", "forges-lines"],
)  # fmt: skip
def test_a_reply_that_fakes_a_pass_gains_nothing(code):
    assert score_reply(TASK, fenced(code)).passed == 0


def test_a_list_of_always_equal_items_does_not_pass():
    task = Task("t/1", "f", "", "f", ("assert f() == [1, 2]", "assert f() == {'a': 1}"), "")
    code = "class Any:\n    __hash__ = object.__hash__\n    def __eq__(self, o):\n        return True\n"
    for body in ("[Any(), Any()]", "{Any(): Any()}", "[1, 2] if len.__name__ else 0"):
        score = score_reply(task, fenced(code + f"def f():\n    return {body}\n"))
        assert score.passed == (1 if body.startswith("[1") else 0)


@pytest.mark.parametrize(
    "code, why",
    [
        ("def rev(s):\n    while True:\n        pass\n", "timed out"),
        ("def rev(s):\n    xs = []\n    while True:\n        xs.append(' ' * 10**7)\n", "out of memory"),
        ("import os\ndef rev(s):\n    try:\n        os.fork()\n    except Exception:\n        pass\n"
         "    return s[::-1]\n", "os.fork"),
        ("import socket\ndef rev(s):\n    try:\n        socket.socket()\n    except Exception:\n        pass\n"
         "    return s[::-1]\n", "socket"),
        ("def rev(s):\n    try:\n        open(ESCAPE, 'w').write('x')\n    except Exception:\n        pass\n"
         "    return s[::-1]\n", "writing outside"),
        ("import subprocess\ndef rev(s):\n    try:\n        subprocess.run(['true'])\n    except Exception:\n"
         "        pass\n    return s[::-1]\n", "not allowed"),
        ("def rev(s):\n    if len(s) == 2:\n        import os\n        os._exit(0)\n    return s[::-1]\n",
         "ended early"),
    ],
    ids=["loops", "allocates", "forks", "socket", "writes", "runs-a-process", "exits-mid-tests"],
)  # fmt: skip
def test_the_sandbox_stops_a_reply_and_it_scores_zero_even_if_it_caught_the_refusal(code, why, tmp_path):
    escape = tmp_path / "escaped"
    score = score_reply(TASK, fenced(code.replace("ESCAPE", repr(str(escape)))), timeout=2)
    assert not score.clean and why in score.why
    assert score.reward("share") == score.reward("pass") == 0.0
    assert not escape.exists()


def test_a_reply_that_broke_the_rules_earns_nothing_for_the_tests_it_passed():
    assert Score(True, True, 3, 4, False, "timed out").reward("share") == 0.0
    assert Score(True, True, 4, 4, False, "timed out").reward("pass") == 0.0
    assert Score(True, True, 3, 4, True).reward("share") == 0.75


def test_a_reply_that_does_not_parse_or_define_the_function_is_not_run():
    assert score_reply(TASK, fenced("def rev(s) return s\n")) == Score(False, False, 0, 4, True, "does not parse")
    assert score_reply(TASK, fenced("def other(s):\n    return s[::-1]\n")).why == "defines no rev"
    assert score_reply(TASK, fenced("def rev(s):\n    return s[::-1]\nrev = None\n")).passed == 0


def test_a_humaneval_check_runs_as_it_is():
    test = "def check(candidate):\n    assert candidate('ab') == 'ba'\n\ncheck(rev)"
    task = Task("h/0", "humaneval", "", "rev", (test,), "")
    assert score_reply(task, fenced(RIGHT)).solved
    assert not score_reply(task, fenced("def rev(s):\n    return s\n")).solved


def test_replies_are_scored_in_order_and_an_unknown_reward_is_refused():
    wrong = fenced("def rev(s):\n    return s\n")
    scores = score_replies([TASK] * 3, [wrong, fenced(RIGHT), wrong], workers=2)
    assert [s.passed for s in scores] == [1, 4, 1]  # '' reversed is ''
    assert REWARDS == ("pass", "share")
    with pytest.raises(ValueError, match="reward='tests'"):
        scores[0].reward("tests")


ADD = Task("t/2", "add", "", "add", ("assert add(1, 2) == 3", "assert 4 == add(2, 2)", "assert add(-1, 1) == 0"), "")
STEAL = """
import os, sys
def add(a, b):
    for path in ('../said/stdout', '/proc/self/fd/1', '/dev/fd/1', 'stdout'):
        try:
            text = open(path, 'rb').read().decode()
        except Exception:
            continue
        for line in text.splitlines():
            if line.endswith((' fail', ' pass')) or ' value ' in line:
                n = line.split()[0]
                os.write(1, f"\\n{n} 0 value 3\\n{n} 1 value 4\\n{n} 2 value 0\\n{n} done\\n".encode())
                os._exit(0)
    return 0
"""
FRAMES = """
import sys
def add(a, b):
    frame = sys._getframe()
    while frame is not None:
        for space in (frame.f_locals, frame.f_globals):
            if 'same' in space:
                space['same'] = lambda got, want: True
        frame = frame.f_back
    return 0
"""


STEAL_FD = STEAL.replace("('../said/stdout', '/proc/self/fd/1', '/dev/fd/1', 'stdout')", "('/proc/self/fd/1',)")


@pytest.mark.parametrize(
    "code", [STEAL, STEAL_FD, FRAMES], ids=["steals-the-nonce", "through-proc-fd", "patches-the-judge"]
)
def test_what_a_test_must_equal_never_reaches_the_reply_so_it_cannot_be_claimed(code):
    score = score_reply(ADD, fenced(code))
    assert score.passed <= 1 and not score.solved  # add returns 0: right for the third test alone


def test_a_value_equal_to_everything_fails_a_literal_on_either_side_and_odd_bytes_are_no_traceback():
    always = "class A:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return A()\n"
    assert score_reply(ADD, fenced(always)).passed == 0
    odd = "import os\ndef add(a, b):\n    os.write(1, b'\\n0 \\xff\\xfe\\n')\n    return a + b\n"
    assert score_reply(ADD, fenced(odd)).solved


def test_values_match_with_exact_types_in_sets_dict_keys_and_a_zero_s_sign():
    from gptforge.tasks.score import same

    assert same({1, (2, 3.0)}, {1, (2, 3.0)}) and same({"a": {1}}, {"a": {1}}) and same(frozenset({1}), frozenset({1}))
    assert same({(1, 2): [0.5]}, {(1, 2): [0.5]}) and same(-0.0, -0.0) and same(2.0, 2.0)
    assert not same({True}, {1}) and not same({(True,)}, {(1,)}) and not same(frozenset({1.0}), frozenset({1}))
    assert not same({True: 1}, {1: 1}) and not same({1: True}, {1: 1}) and not same({1: 1, 2: 2}, {1: 1})
    assert not same(-0.0, 0.0) and not same(0.0, -0.0) and not same([-0.0], [0.0]) and not same(1, 1.0)
