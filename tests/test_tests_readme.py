"""tests/README.md lists every test file, and only files that exist; conftest's LONG_FILES (the order `make test`
hands files to its workers) names only files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import LONG_FILES

TESTS = Path(__file__).resolve().parent


def test_the_tests_readme_lists_every_test_file():
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", (TESTS / "README.md").read_text(), re.M))
    present = {p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")}
    assert sorted(present - listed) == [], "add these to tests/README.md"
    assert sorted(listed - present) == [], "these are listed in tests/README.md but gone"


def test_long_files_name_test_files_that_exist():
    assert sorted(name for name in LONG_FILES if not (TESTS / name).is_file()) == [], "gone or renamed"
    assert len(set(LONG_FILES)) == len(LONG_FILES)
