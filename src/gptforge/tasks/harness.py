"""The child side of scoring one reply, run as the sandbox's program (runtime/sandbox.py) in a throwaway
folder holding task.json: read the run's nonce from stdin, run the reply's code as a module, then each test, and
report each result on a copy of stdout as "NONCE index pass|fail|memory", then "NONCE done".

Only lines that carry the nonce count, so a reply that prints "passed" or exits early gains nothing. A test of
the form `assert CALL == LITERAL` is judged here by exact types, so a value whose `__eq__` always answers True
gains nothing either; other tests (HumanEval's `check`) pass when they raise nothing.
"""

import ast
import json
import os
import sys

# Saved before the reply runs: it may rebind any builtin it likes in its own module, not these.
SCALARS = (int, float, complex, str, bytes, bool, type(None))
_type, _len, _zip, _all, _isinstance = type, len, zip, all, isinstance
_compile, _eval, _exec, _write = compile, eval, exec, os.write


def same(got: object, want: object) -> bool:
    """`got == want` for the builtin values a literal can hold, with the types exact at every level."""
    kind = _type(want)
    if _type(got) is not kind:
        return False
    if kind in (list, tuple):
        return _len(got) == _len(want) and _all(same(g, w) for g, w in _zip(got, want))
    if kind is dict:
        if not _all(_type(k) in SCALARS for k in got) or _len(got) != _len(want):
            return False
        return _all(k in got and same(got[k], v) for k, v in want.items())
    if kind in (set, frozenset):
        return _all(_type(k) in SCALARS for k in got) and got == want
    return kind in SCALARS and got == want


def compare(test: str) -> tuple[str, object] | None:
    """(the call's source, the literal it must equal) for `assert CALL == LITERAL`; None for any other test."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return None
    if _len(tree.body) != 1 or not _isinstance(tree.body[0], ast.Assert):
        return None
    check = tree.body[0].test
    if not _isinstance(check, ast.Compare) or check.ops[0].__class__ is not ast.Eq or _len(check.ops) != 1:
        return None
    try:
        want = ast.literal_eval(check.comparators[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return ast.unparse(check.left), want


def main() -> None:
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    with open("task.json", encoding="utf-8") as f:
        task = json.load(f)
    os.remove("task.json")
    report = os.dup(1)
    tests = [(test, compare(test)) for test in task["tests"]]

    def say(what: str) -> None:
        _write(report, f"\n{nonce} {what}\n".encode())  # on a line of its own after what the reply printed

    module = {"__name__": "reply", "__builtins__": __builtins__}
    try:
        _exec(_compile(task["code"], "reply.py", "exec"), module)
    except MemoryError:
        say("memory")
        return
    except BaseException:  # noqa: BLE001 (SystemExit included: the reply's module failed, every test with it)
        say("done")
        return
    for index, (test, parts) in enumerate(tests):
        try:
            if parts is None:
                _exec(_compile(test, f"test{index}", "exec"), module)
                passed = True
            else:
                passed = same(_eval(_compile(parts[0], f"test{index}", "eval"), module), parts[1])
        except MemoryError:
            say("memory")
            return
        except BaseException:  # noqa: BLE001 (a test that raises, SystemExit included, fails)
            passed = False
        say(f"{index} {'pass' if passed else 'fail'}")
    say("done")


if __name__ == "__main__":
    main()
