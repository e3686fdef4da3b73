"""Real Prometheus / promtool (Debian's package, unpacked under .work by `make setup`)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.serving.local_vllm import free_port
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


@contextlib.contextmanager
def start_pushgateway(log_dir: Path) -> Iterator[str]:
    """A real Pushgateway on a free loopback port; yields its URL."""
    port = free_port()
    cmd = [str(PROM_BIN / "prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(log_dir / "pushgateway.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/-/ready", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, (log_dir / "pushgateway.log").read_text()
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def pushgateway(tmp_path: Path) -> Iterator[str]:
    with start_pushgateway(tmp_path) as url:
        yield url
