"""Shared fixtures: a small synthetic code corpus, prepared once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gptforge.data.prepare import prepare
from gptforge.data.prepare_settings import PrepareSettings

# Tests run on the CPU even where a GPU is visible (subprocesses inherit this): the same numbers on every machine.
# GPTFORGE_GPU_TESTS=1 keeps the GPU for tests/gpu (which a CPU-only machine skips) and runs nothing else.
GPU_TESTS = bool(os.environ.get("GPTFORGE_GPU_TESTS"))
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if GPU_TESTS:
        cpu_only = pytest.mark.skip(reason="GPTFORGE_GPU_TESTS=1 runs tests/gpu only (the rest would see the GPU)")
        for item in items:
            if "tests/gpu/" not in item.nodeid:
                item.add_marker(cpu_only)


TEMPLATE = '''def {name}(values):
    """Return the {what} of values."""
    total = 0
    for v in values:
        total = total {op} v
    return total


class {cls}:
    def __init__(self, items):
        self.items = list(items)

    def {name}(self):
        return {name}(self.items)
'''


def write_corpus(root: Path, n_files: int = 60) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    ops = [
        ("add_all", "sum", "+", "Adder"),
        ("mul_all", "product", "*", "Multiplier"),
        ("sub_all", "difference", "-", "Subtractor"),
        ("xor_all", "parity", "^", "Xorer"),
    ]
    for i in range(n_files):
        name, what, op, cls = ops[i % len(ops)]
        (root / f"mod_{i:03d}.py").write_text(TEMPLATE.format(name=f"{name}_{i}", what=what, op=op, cls=f"{cls}{i}"))
    return root


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare(PrepareSettings.from_flags(str(corpus_dir), val_fraction=0.1, shard_tokens=2000), out, workers=2)
    return out
