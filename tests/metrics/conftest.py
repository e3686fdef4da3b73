"""Real Prometheus / promtool (Debian's package, unpacked under .work by `make setup`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.driver.conftest import fault_server, make_request  # noqa: F401 - fixtures reused

REPO = Path(__file__).resolve().parents[2]
PROM_BIN = REPO / ".work" / "prometheus" / "usr" / "bin"


@pytest.fixture(scope="session")
def promtool() -> Path:
    path = PROM_BIN / "promtool"
    assert path.exists(), "promtool missing: run `make system-packages`"
    return path


def check_metrics(promtool: Path, text: str) -> subprocess.CompletedProcess:
    """`promtool check metrics` (lint: names, units, HELP, types) on an exposition."""
    return subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
