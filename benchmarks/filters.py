"""What `--clean code` removes from the standard library and `--clean web` from prose, and how fast each runs.

    python benchmarks/filters.py [--prose DIR ...] [--examples 5]

Code: every .py file of this interpreter's standard library. Prose: the standard library's .txt/.rst/.md
files, its docstrings (one document per module), and the .md/.rst/.txt files under each --prose folder.
Speed is the best of three passes on one core: 'first failure' stops at the filter that removes a document
(what prepare does), 'every filter' runs all of them on every document (the cost on a corpus that passes).
"""

from __future__ import annotations

import argparse
import ast
import collections
import sysconfig
import time
from pathlib import Path

from gptforge.data.clean.filters import build_filters, first_failure
from gptforge.data.languages import language_of
from gptforge.data.sources import stdlib_documents


def prose_documents(folders: list[str]) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for base, prefix in [(root, "stdlib/"), *((Path(f), f"{f}/") for f in folders)]:
        for path in sorted(base.rglob("*")):
            if path.suffix in (".txt", ".rst", ".md") and "site-packages" not in path.parts and path.is_file():
                try:
                    docs.append((prefix + path.relative_to(base).as_posix(), path.read_text(encoding="utf-8")))
                except (UnicodeDecodeError, OSError):
                    continue
    for name, text in stdlib_documents():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        strings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        if any(strings):
            docs.append((f"{name}:docstrings.txt", "\n\n".join(s for s in strings if s)))
    return docs


def best_of_three(run) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(mode: str, docs: list[tuple[str, str]], examples: int) -> None:
    filters = build_filters(mode)
    size = sum(len(text.encode()) for _, text in docs)
    removed: dict[str, list[tuple[str, int, str]]] = collections.defaultdict(list)
    for name, text in docs:
        failure = first_failure(filters, text, language_of(name))
        if failure:
            removed[failure[0]].append((name, len(text.encode()), failure[1]))
    gone = sum(b for rows in removed.values() for _, b, _ in rows)
    print(f"\n## --clean {mode}: {len(docs):,} documents, {size / 1e6:.2f} MB")
    print(f"removed {sum(map(len, removed.values())):,} documents, {gone / 1e6:.3f} MB ({100 * gone / size:.2f}%)")
    print("| filter | documents | bytes | examples |\n| --- | --- | --- | --- |")
    for f in filters:
        rows = removed.get(f.name, [])
        shown = "; ".join(f"`{n}` ({r})" for n, _, r in rows[:examples])
        print(f"| {f.name} | {len(rows):,} | {sum(b for _, b, _ in rows):,} | {shown} |")
    labelled = [(text, language_of(name)) for name, text in docs]
    first = best_of_three(lambda: [first_failure(filters, text, lang) for text, lang in labelled])
    every = best_of_three(lambda: [f.reason(text, lang) for text, lang in labelled for f in filters])
    print(f"speed: first failure {size / 1e6 / first:.1f} MB/s, every filter {size / 1e6 / every:.1f} MB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prose", nargs="*", default=[], help="folders of .md/.rst/.txt files to add")
    parser.add_argument("--examples", type=int, default=5)
    args = parser.parse_args()
    measure("code", list(stdlib_documents()), args.examples)
    measure("web", prose_documents(args.prose), args.examples)


if __name__ == "__main__":
    main()
