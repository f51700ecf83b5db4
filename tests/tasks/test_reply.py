"""A reply's answer: the code it offers, whether that parses and defines the function asked for."""

import pytest

from gptforge.tasks.reply import answer

DEF = "def twice(x):\n    return 2 * x\n"


@pytest.mark.parametrize(
    ("reply", "code", "parses", "defines"),
    [
        (DEF, DEF, True, True),  # bare code
        (f"Here it is:\n```python\n{DEF}```\nIt doubles x.", DEF, True, True),
        (f"```\n{DEF}```", DEF, True, True),  # a fence without a language
        (f"```py\n{DEF}", DEF, True, True),  # a reply cut before its closing fence
        (f"```python\nimport math\n```\nthen\n```python\n{DEF}```", DEF, True, True),  # the block that defines it
        ("```python\nx = 1\n```", "x = 1\n", True, False),  # parses, defines nothing asked for
        ("def twice(x):\n    return (", "def twice(x):\n    return (", False, False),
        ("class A:\n    def twice(self, x):\n        return x\n", None, True, False),  # a method is not it
        ("def twice_it(x):\n    return x\n", None, True, False),
        ("Sure! The answer is to double x.", None, False, False),
        ("def twice(x):\n    return x\x00\n", None, False, False),
    ],
)
def test_the_answer_of_a_reply(reply, code, parses, defines):
    got = answer(reply, "twice")
    assert (got.parses, got.defines) == (parses, defines)
    if code is not None:
        assert got.code == code
