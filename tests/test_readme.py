"""The promises table (docs/promises.md, linked from the README) names tests that exist, so it cannot drift from the
suite."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_test_the_promises_table_names_exists():
    assert "docs/promises.md" in (ROOT / "README.md").read_text()
    table = (ROOT / "docs" / "promises.md").read_text()
    named_tests = set(re.findall(r"`(test_\w+)`", table))
    named_files = set(re.findall(r"`(tests/[\w/]+\.py)`", table))
    assert len(named_tests) >= 20 and named_files
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.MULTILINE))
    assert named_tests - defined == set()
    assert {f for f in named_files if not (ROOT / f).is_file()} == set()
