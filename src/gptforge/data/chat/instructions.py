"""Offline instruction data for a code model: conversations built from documented Python functions, and from
the built-in verifiable tasks.

For each function or method with a docstring, the user asks for a function with that name, signature and the
docstring's description, and the assistant answers with the function's source. Built from any Python documents
(the standard library for the embedded default), so it needs nothing from the network. A built-in task's request
is answered with its reference solution (training tasks and drills in train, held-out ones in val).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gptforge.data.pipeline import is_validation
from gptforge.tasks.builtin import builtin_tasks, drill_tasks
from gptforge.tasks.reply import parsed
from gptforge.tokens.chat import Message

TASK_SOURCE = "builtin:"  # how a built-in task's row names its source
DRILL_SOURCE = f"{TASK_SOURCE}drill/"  # and a drill's

MAX_SOURCE_CHARS = 1500  # a reply must fit the demo's context with its request (~4 characters a token)
MIN_SOURCE_LINES = 3


@dataclass(frozen=True)
class FunctionTask:
    """One conversation: `document` names the file it came from (the split follows the file's)."""

    document: str
    name: str
    messages: tuple[Message, ...]


def function_tasks(documents: Iterable[tuple[str, str]]) -> Iterator[FunctionTask]:
    """Conversations from every documented function of `documents` ((name, Python source) pairs) that parses and
    is short enough; in source order."""
    for doc_name, text in documents:
        tree = parsed(text)
        if tree is None:
            continue
        lines = text.splitlines(keepends=True)
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda n: n.lineno):  # ast.walk goes breadth first
            task = _task(doc_name, lines, node)
            if task is not None:
                yield task


def conversation_rows(documents: Iterable[tuple[str, str]], val_fraction: float, seed: int = 0) -> Iterator[dict]:
    """`prepare --chat` rows of every function task, each in the split its file has when `prepare` holds out
    `val_fraction` of the same documents: a held-out conversation comes from a file no training one comes from."""
    for index, (name, text) in enumerate(documents):
        split = "val" if is_validation(name, index, val_fraction, seed) else "train"
        for task in function_tasks([(name, text)]):
            messages = [{"role": m.role, "content": m.content} for m in task.messages]
            yield {"messages": messages, "split": split, "source": f"{name}:{task.name}"}


def task_rows(train: int, val: int, drills: int = 0, seed: int = 0) -> Iterator[dict]:
    """`prepare --chat` rows of `train` built-in training tasks, `drills` training-only drills and `val` held-out
    tasks, each answered with its reference solution (repeated tasks among them are one for prepare's
    de-duplication)."""
    splits = (("train", builtin_tasks("train", train, seed)), ("train", drill_tasks(drills, seed)))
    for split, tasks in (*splits, ("val", builtin_tasks("val", val, seed))):
        for task in tasks:
            reply = task.solution.rstrip()  # as a function's source is, in the rows above
            messages = [{"role": "user", "content": task.request}, {"role": "assistant", "content": reply}]
            yield {"messages": messages, "split": split, "source": f"{TASK_SOURCE}{task.name}"}


def request_text(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The user's request for `node`: its signature and the docstring's first paragraph."""
    doc = ast.get_docstring(node)
    description = doc.strip().split("\n\n")[0].strip() if doc else ""
    if not description:
        return None
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    kind = "async function" if isinstance(node, ast.AsyncFunctionDef) else "function"
    signature = f"{node.name}({ast.unparse(node.args)}){returns}"
    return f"Write a Python {kind} `{signature}`.\n{description}"


def _task(doc_name: str, lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> FunctionTask | None:
    request = request_text(node)
    if request is None or node.end_lineno is None:
        return None
    # Whole lines from `def` to the body's end (decorators are not part of the answer); a method is dedented.
    source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
    if len(source) > MAX_SOURCE_CHARS or source.count("\n") + 1 < MIN_SOURCE_LINES:
        return None
    if not defines_function(source, node.name):  # a method of Python 2 test data, or one cut oddly
        return None
    messages = (Message("user", request), Message("assistant", source))
    return FunctionTask(document=doc_name, name=node.name, messages=messages)


def defines_function(reply: str, name: str) -> bool:
    """The reply parses as Python and defines a function called `name` (the measure of a fine-tuned reply)."""
    tree = parsed(reply)
    return tree is not None and any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree)
    )
