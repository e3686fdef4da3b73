"""The tier check (tests/tiers.py) rejects a test that starts a process without its marker.

A planted test file runs in its own pytest, with this suite's tier hooks: the unmarked one that
starts ``true`` fails naming the process and the marker to add; the same test marked ``service``
passes, and so does an unmarked one that starts nothing. Also the code under test swallowing the
refusal does not hide it (the teardown check)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.service  # it runs pytest in a subprocess

REPO = Path(__file__).resolve().parents[2]
PLANTED = '''
import subprocess

import pytest


def test_starts_a_process_without_a_marker():
    subprocess.run(["true"], check=True)


def test_swallows_the_refusal():
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass


@pytest.mark.service
def test_starts_a_process_marked_service():
    subprocess.run(["true"], check=True)


def test_starts_nothing():
    assert sum(range(4)) == 6
'''


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *args, str(folder)], cwd=folder, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_planted_unmarked_test_that_starts_a_process_fails(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.tiers import configure, mark_units\n"
        "from tests.tiers import pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401\n"
        "def pytest_configure(config):\n    configure(config)\n"
        "def pytest_collection_modifyitems(config, items):\n    mark_units(items)\n")
    (tmp_path / "test_planted.py").write_text(PLANTED)
    proc = pytest_in(tmp_path, "-rA")
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "PASSED test_planted.py::test_starts_a_process_marked_service" in out
    assert "PASSED test_planted.py::test_starts_nothing" in out
    assert "FAILED test_planted.py::test_starts_a_process_without_a_marker" in out
    assert "ERROR test_planted.py::test_swallows_the_refusal" in out
    assert re.search(r"tier check: test_planted.py::test_starts_a_process_without_a_marker started a "
                     r"process \(subprocess.Popen b?'true'", out), out
    assert "add `pytestmark = pytest.mark.service`" in out
    # -m unit selects the unmarked ones only.
    listed = pytest_in(tmp_path, "--collect-only", "-m", "unit")
    assert "3/4 tests collected" in listed.stdout, listed.stdout
