"""The README's promises name tests that exist, so the table cannot drift from the suite."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_test_the_promises_table_names_exists():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Promises", 1)[1].split("\n## ", 1)[0]
    named_tests = set(re.findall(r"`(test_\w+)`", table))
    named_files = set(re.findall(r"`(tests/[\w/]+\.py)`", table))
    assert len(named_tests) >= 20 and named_files
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.MULTILINE))
    assert named_tests - defined == set()
    assert {f for f in named_files if not (ROOT / f).is_file()} == set()
