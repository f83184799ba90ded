"""`make test`'s serial part collects only the files whose text says `pytest.mark.serial` (the Makefile's
SERIAL_FILES, a grep); tests/conftest.py refuses a serial test marked any other way, which would otherwise run in
neither part (the parallel part deselects it, the serial part never collects its file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import SERIAL_MARK

REPO = Path(__file__).resolve().parent.parent


def _collect(folder: Path, test_source: str) -> subprocess.CompletedProcess[str]:
    """Collect one test file beside a copy of the suite's conftest."""
    tests = folder / "tests"
    tests.mkdir(exist_ok=True)
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text(encoding="utf-8"))
    (tests / "test_marked.py").write_text(test_source)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: alone\n")
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120)


def test_a_serial_test_whose_file_the_grep_would_miss_is_refused_in_one_line(tmp_path):
    named = _collect(tmp_path, "import pytest\nalone = pytest.mark.serial\n\n@alone\ndef test_x():\n    pass\n")
    assert named.returncode == 0, named.stdout + named.stderr  # the words are in the file: the grep finds it

    hidden = _collect(
        tmp_path, "import pytest\nalone = getattr(pytest.mark, 'ser' + 'ial')\n\n@alone\ndef test_x():\n    pass\n"
    )
    assert hidden.returncode != 0
    assert (
        "ERROR: test_marked.py: mark serial tests with `@pytest.mark.serial` or `pytestmark = pytest.mark.serial` "
        "(the Makefile's serial part greps for it)"
    ) in hidden.stderr


def test_the_makefile_greps_for_the_mark_the_conftest_checks():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert f'SERIAL_FILES = $(shell grep -l "{SERIAL_MARK}" tests/test_*.py)' in makefile
    assert "-m serial --junitxml=build/test-reports/serial.xml \\\n\t\t$(SERIAL_FILES)" in makefile
