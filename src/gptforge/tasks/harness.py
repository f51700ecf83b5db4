"""The child side of scoring one reply, run as the sandbox's program (runtime/sandbox.py) in a throwaway folder
holding task.json: read the run's nonce from stdin, run the reply's code as a module, then each test, and report
on a copy of stdout, each line "NONCE index ...", then "NONCE done".

An `assert CALL == LITERAL` test arrives as its call alone: its value is reported ("value REPR", builtin types
only) and judged by the parent, so what it must equal never enters this process and no reply can claim it. Other
tests (HumanEval's `check`) run here and report "pass" when they raise nothing; only lines that carry the nonce
count, so printing "passed" or exiting early gains nothing.
"""

import json
import os
import sys

PLAIN = (int, float, complex, str, bytes, bool, type(None))
# Saved before the reply runs: it may rebind any builtin it likes, not these.
_type, _all, _repr, _compile, _eval, _exec, _write = type, all, repr, compile, eval, exec, os.write


def plain(value: object) -> bool:
    """Builtin scalars and containers of them, the types exact at every level: what a literal can hold."""
    kind = _type(value)
    if kind in PLAIN:
        return True
    if kind in (list, tuple, set, frozenset):
        return _all(plain(v) for v in value)
    return kind is dict and _all(plain(k) and plain(v) for k, v in value.items())


def main() -> None:
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    with open("task.json", encoding="utf-8") as f:
        task = json.load(f)
    os.remove("task.json")
    report = os.dup(1)

    def say(what: str) -> None:
        _write(report, f"\n{nonce} {what}\n".encode(errors="backslashreplace"))  # a line of its own

    module = {"__name__": "reply", "__builtins__": __builtins__}
    try:
        _exec(_compile(task["code"], "reply.py", "exec"), module)
    except MemoryError:
        say("memory")
        return
    except BaseException:  # noqa: BLE001 (SystemExit included: the reply's module failed, every test with it)
        say("done")
        return
    for index, call in task["calls"]:
        try:
            value = _eval(_compile(call, f"test{index}", "eval"), module)
            say(f"{index} value {_repr(value)}" if plain(value) else f"{index} fail")
        except MemoryError:
            say("memory")
            return
        except BaseException:  # noqa: BLE001 (a test that raises, SystemExit included, fails)
            say(f"{index} fail")
    for index, statement in task["statements"]:
        try:
            _exec(_compile(statement, f"test{index}", "exec"), module)
            say(f"{index} pass")
        except MemoryError:
            say("memory")
            return
        except BaseException:  # noqa: BLE001
            say(f"{index} fail")
    say("done")


if __name__ == "__main__":
    main()
