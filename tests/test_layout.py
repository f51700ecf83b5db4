"""The package's shape: imports flow one way through the stages, and no function outgrows a screen or two."""

import ast
from pathlib import Path

import gptforge

ROOT = Path(gptforge.__file__).parent

# Lowest first: a module may import from a lower layer, or from its own package, never from a higher layer.
LAYERS = [
    {"errors"},
    {"files", "inputs"},
    {"outputs"},
    {"runtime"},
    {"tokens", "tasks"},
    {"model", "data"},
    {"config"},
    {"checkpoint", "rundir"},
    {"hub"},
    {"eval"},  # above hub: the lm-eval bridge scores a checkpoint through its Hugging Face export
    {"train"},
    {"bench", "sample", "report", "serve"},
    {"demo"},
    {"speedrun"},
    {"commands"},
    {"cli"},
    {"__main__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
# Inside data, cleaning decides from a document's text alone: of the rest of data it reads only the table of file
# types, never the stream (sources, tokenizer, shards, loader), prepare, or chat.
CLEAN = "gptforge.data.clean"
CLEAN_MAY_IMPORT = {"gptforge.data", "gptforge.data.languages"}
MAX_FUNCTION_LINES = 80


def _part(module: str) -> str:
    """The stage a dotted module belongs to: 'gptforge.train.step' -> 'train'."""
    return module.split(".")[1]


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        dotted = ".".join(("gptforge", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        out[dotted] = ast.parse(path.read_text())
    return out


def _imports(module: str, tree: ast.Module) -> set[str]:
    """The gptforge modules `module` imports, however spelled: `import a.b`, `from a.b import c`, `from a import b`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}: relative import (the package imports absolutely)"
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from gptforge import config`
    return {n for n in names if n in MODULES and n != "gptforge"}


MODULES = _modules()


def test_every_module_belongs_to_a_layer():
    parts = {_part(m) for m in MODULES if m != "gptforge"}
    assert parts <= set(RANK), parts - set(RANK)


def test_imports_flow_down_the_stages():
    upward = []
    for module, tree in MODULES.items():
        if module == "gptforge":
            continue
        for imported in _imports(module, tree):
            mine, theirs = _part(module), _part(imported)
            if mine != theirs and RANK[theirs] >= RANK[mine]:
                upward.append(f"{module} imports {imported}")
    assert not upward, upward


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_cleaning_reads_nothing_of_data_but_the_file_types():
    reached = [
        f"{module} imports {imported}"
        for module, tree in MODULES.items()
        if _inside(module, CLEAN)
        for imported in _imports(module, tree)
        if _inside(imported, "gptforge.data") and not _inside(imported, CLEAN) and imported not in CLEAN_MAY_IMPORT
    ]
    assert not reached, reached


def test_the_stream_never_imports_chat():
    stream = [m for m in MODULES if m.count(".") == 2 and _inside(m, "gptforge.data")]  # data/*.py, not its packages
    reached = [f"{m} imports {i}" for m in stream for i in _imports(m, MODULES[m]) if _inside(i, "gptforge.data.chat")]
    assert len(stream) > 10 and not reached, reached


def test_no_import_cycles_between_modules():
    graph = {m: _imports(m, t) for m, t in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_no_function_over_80_lines():
    long = [
        f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for module, tree in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_generating_serving_and_exporting_need_no_data_pipeline():
    """Tokens (the tokenizer, FIM's sentinels, the chat template) are their own package: a model is served,
    sampled, saved and exported without importing the data pipeline."""
    users = ("model", "checkpoint", "hub", "serve", "sample")
    found = [
        f"{module} imports {imported}"
        for module, tree in MODULES.items()
        if module != "gptforge" and _part(module) in users
        for imported in _imports(module, tree)
        if _part(imported) == "data"
    ]
    assert not found, found
