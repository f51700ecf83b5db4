"""The package's shape: imports flow one way through the stages, and no function outgrows a screen or two."""

import ast
from pathlib import Path

import gptforge

ROOT = Path(gptforge.__file__).parent

# Lowest first: a module may import from a lower layer, or from its own package, never from a higher layer.
LAYERS = [
    {"errors"},
    {"files"},
    {"runtime"},
    {"model", "data"},
    {"config"},
    {"checkpoint"},
    {"eval", "hub"},
    {"train"},
    {"bench", "sample", "report"},
    {"demo"},
    {"cli"},
    {"__main__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}
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


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gptforge."):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("gptforge."))
    return names


def test_every_module_belongs_to_a_layer():
    parts = {_part(m) for m in _modules() if m != "gptforge"}
    assert parts <= set(RANK), parts - set(RANK)


def test_imports_flow_down_the_stages():
    upward = []
    for module, tree in _modules().items():
        if module == "gptforge":
            continue
        for imported in _imports(tree):
            mine, theirs = _part(module), _part(imported)
            if mine != theirs and RANK[theirs] >= RANK[mine]:
                upward.append(f"{module} imports {imported}")
    assert not upward, upward


def test_no_import_cycles_between_modules():
    graph = {m: {i for i in _imports(t) if i in _modules()} for m, t in _modules().items()}
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
        for module, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long
