"""The suite's tiers, and the check that keeps each test in its own.

- ``unit``: starts no process (the default: a test with neither marker below is a unit test, and
  ``make test-fast`` runs these).
- ``service``: starts real services or programs (vLLM, SeaweedFS, Redis, Prometheus, the router,
  kubectl, a CLI run as a subprocess), each test or module on its own.
- ``e2e``: end-to-end runs of the pipeline: Airflow stacks or ``dags test``, images, browsers.

The check: a unit test that starts a process fails, naming the process and the marker to add. It
is a CPython audit hook (``sys.addaudithook``) on the events every way of starting a process
raises (``subprocess.Popen``, ``os.posix_spawn``, ``os.fork``, ``os.exec``, ``os.system``), armed
while a unit test's fixtures are set up and its body runs (the standard library's platform probes,
which libraries run at import or first use, are let through). The hook raises at the start (so the
process never runs), and the test also fails at teardown in case the code under test swallowed
that error.
docs/testing.md has the tiers and how to run each.
"""

from __future__ import annotations

import ctypes.util
import platform
import sys
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "service", "e2e")
MARKERS = {
    "unit": "starts no process (the default for a test with no tier marker); `make test-fast`",
    "service": "starts real services or programs (servers, binaries, subprocesses)",
    "e2e": "end-to-end pipeline runs: Airflow stacks, `dags test`, images, browsers",
}
# Audit events raised by every way of starting a process (CPython 3.11's audit events table).
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                            "os.exec", "os.system", "os.startfile", "pty.spawn"})


class ProcessStartedInUnitTest(RuntimeError):
    """A test without a service or e2e marker started a process."""


class _Guard:
    def __init__(self) -> None:
        self.test: str | None = None  # the unit test whose fixtures or body are running
        self.started: list[str] = []

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.test is None or event not in PROCESS_EVENTS or _platform_probe():
            return
        what = f"{event} {_describe(args)}"
        self.started.append(what)
        test, self.test = self.test, None  # raise once; the teardown check reports the rest
        raise ProcessStartedInUnitTest(
            f"tier check: {test} started a process ({what}) but is a unit test; a test that starts "
            "processes is marked `service` (or `e2e` for pipeline runs): add `pytestmark = "
            "pytest.mark.service` to its module (tests/tiers.py, docs/testing.md)")


# The standard library's platform probes: ``platform`` runs ``uname -p`` and ``file -b``
# (``platform.processor()``, ``platform.architecture()``), ``ctypes.util.find_library`` runs
# ``ldconfig -p`` (then gcc, ld). Libraries call them at import (croniter, trio) or on first use
# (the openai SDK's platform headers, once per process, so whichever unit test sends the first
# request would be flagged): the library's probes, not processes a test starts.
_PROBES = (str(Path(platform.__file__)), str(Path(ctypes.util.__file__)))


def _platform_probe() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _PROBES:
            return True
        frame = frame.f_back
    return False


def _describe(args: tuple[Any, ...]) -> str:
    if args and isinstance(args[0], (str, bytes)):
        return repr(args[0])[:120]
    if len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1]:
        return repr(list(args[1])[:3])[:120]
    return ""


GUARD = _Guard()


def tier_of(item: pytest.Item) -> str:
    marked = [t for t in ("service", "e2e") if item.get_closest_marker(t) is not None]
    if len(marked) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(marked)}: one tier per test")
    return marked[0] if marked else "unit"


def configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    sys.addaudithook(GUARD.audit)  # for the life of the process: hooks cannot be removed


def mark_units(items: list[pytest.Item]) -> None:
    """Give every test without a tier marker the ``unit`` marker (so ``-m unit`` selects them)."""
    for item in items:
        if tier_of(item) == "unit" and item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # type: ignore[no-untyped-def]
    GUARD.started = []
    GUARD.test = item.nodeid if tier_of(item) == "unit" else None
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    # Disarmed for the teardown: the last test of a module or session also tears down fixtures an
    # earlier service test set up (stopping a server may run a program: pg_ctl, podman).
    GUARD.test = None
    yield
    started, GUARD.started = GUARD.started, []
    if started:
        pytest.fail(f"tier check: {item.nodeid} is a unit test and started {len(started)} process(es): "
                    f"{'; '.join(started[:3])}; mark its module `service` or `e2e` (docs/testing.md)",
                    pytrace=False)
