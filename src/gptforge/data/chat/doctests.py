"""Verifiable tasks mined from a corpus's doctests: a module-level function whose docstring shows calls of it on
literal arguments with literal results becomes a request (its signature and its docstring without the examples)
and hidden tests (those examples as `assert name(...) == result`). A task takes its file's split as `prepare`
holds files out, so a corpus's validation files give the held-out tasks. Only tasks that their own function
passes in the sandbox are kept (with the module's imports, alone: one needing the rest of its module is out)."""

from __future__ import annotations

import ast
import doctest
import textwrap
from collections.abc import Iterable

from gptforge.data.pipeline import is_validation
from gptforge.tasks.builtin import SPLITS, Task
from gptforge.tasks.reply import parsed
from gptforge.tasks.score import score_replies

DOCTESTS = "doctests:"  # a task source that names a corpus: doctests:stdlib, doctests:FOLDER
VAL_FRACTION = 0.02  # the demo's split of its corpus: the files it holds out give the held-out tasks
FAMILY = "doctest"


def doctest_tasks(
    documents: Iterable[tuple[str, str]], split: str, val_fraction: float = VAL_FRACTION, seed: int = 0
) -> list[Task]:
    """The tasks of `split` among `documents` ((name, Python source) pairs, in `prepare`'s order), each of which
    its own function passes."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    found = []
    for index, (name, text) in enumerate(documents):
        if is_validation(name, index, val_fraction, seed) == (split == "val"):
            found.extend(_file_tasks(name, text))
    scores = score_replies(found, [task.solution for task in found])
    return [task for task, score in zip(found, scores, strict=True) if score.passed == score.tests]


def _file_tasks(name: str, text: str) -> list[Task]:
    tree = parsed(text)
    if tree is None:
        return []
    lines = text.splitlines(keepends=True)
    imports = "".join(f"{ast.unparse(n)}\n" for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom))
    tasks = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        parts = _examples(node)
        if parts is None:
            continue
        description, tests = parts
        source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
        signature = f"{node.name}({ast.unparse(node.args)})"
        request = f"Write a Python function `{signature}`.\n{description}".rstrip()
        solution = f"{imports}\n\n{source}\n" if imports else f"{source}\n"
        tasks.append(Task(f"{name}:{node.name}", FAMILY, request, node.name, tests, solution))
    return tasks


def _examples(node: ast.FunctionDef) -> tuple[str, tuple[str, ...]] | None:
    """(the docstring without its examples, an assertion for each example that calls the function on literals
    with a literal result); None when no example does."""
    doc = ast.get_docstring(node)
    if not doc or ">>>" not in doc:
        return None
    try:
        pieces = doctest.DocTestParser().parse(doc)
    except ValueError:  # an example whose indentation doctest itself refuses
        return None
    tests = tuple(test for piece in pieces if isinstance(piece, doctest.Example) if (test := _test(piece, node.name)))
    if not tests:
        return None
    prose = "".join(piece for piece in pieces if isinstance(piece, str))
    description = "\n\n".join(p.strip() for p in prose.split("\n\n") if p.strip())
    return description, tests


def _test(example: doctest.Example, name: str) -> str | None:
    """`assert CALL == RESULT` for an example `name(literals...)` whose output is a literal, else None."""
    try:
        call = ast.parse(example.source.strip(), mode="eval").body
        want = ast.parse(example.want.strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == name):
            return None
        for value in [*call.args, *(k.value for k in call.keywords), want]:
            ast.literal_eval(value)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):  # *args: not a literal either
        return None
    if any(k.arg is None for k in call.keywords):  # **{...} is a literal, but not an argument's name
        return None
    return f"assert {ast.unparse(call)} == {ast.unparse(want)}"
