"""What a chat reply offers as the answer to a task: its code (the first fenced block that defines the function
asked for, else the first block, else the whole reply), whether that parses, and whether it defines the function."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Answer:
    code: str
    parses: bool
    defines: bool  # a module-level `def` of the entry point


def answer(reply: str, entry_point: str) -> Answer:
    blocks = FENCE.findall(reply)
    candidates = blocks or [reply]
    code = next((c for c in candidates if _defines(parsed(c), entry_point)), candidates[0])
    tree = parsed(code)
    return Answer(code, tree is not None, _defines(tree, entry_point))


def parsed(code: str) -> ast.Module | None:
    """`code`'s syntax tree, or None when it is not Python: a NUL byte (ValueError on older Pythons) and nesting
    past the parser's depth (MemoryError, RecursionError) included."""
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def _defines(tree: ast.Module | None, entry_point: str) -> bool:
    return tree is not None and any(
        isinstance(node, ast.FunctionDef) and node.name == entry_point for node in tree.body
    )
