"""Shared by both test environments (orchestrator and inference): keep imports light."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import durations, starts, tiers
from tests.tiers import pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401 - hooks

REPO_ROOT = Path(__file__).resolve().parents[1]
RECORDER = durations.Recorder()

# Both suites run several vLLM servers at once (two xdist workers, module fixtures, servers a test
# starts itself) on machines with as few as two cores. vLLM's automatic CPU binding pins every
# server's engine to the same core (core 0 there; the last core is kept for other processes), and
# explicit pins per test ("0" here, "1" there) collide the same way once two files run at once: a
# server starting beside a busy one waits on that core. In a clean-clone run (2026-12-03) two
# servers took over 240 s to start and failed the nightly-eval and endpoint tests, and by hand a
# second server beside a loaded one was not up after 13 minutes, against 125 s unpinned. Unpinned
# with one OpenMP thread each (the thread count a one-core pin gives, so the same numerics, and the
# kvcache connector still copies inline: host_copy.host_threads), the kernel spreads them over the
# cores. Set in the environment the servers inherit; a value set by whoever runs the suite wins,
# and benches pin explicitly (LocalServer's threads_bind).
UNPINNED_VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def pytest_configure(config: pytest.Config) -> None:
    tiers.configure(config)
    starts.install()
    config.pluginmanager.register(RECORDER, "aibrix-durations")
    config.addinivalue_line("markers", "double_only(reason): needs the Kubernetes API double's insides; "
                            "deselected when K8S_TEST_KUBECONFIG points the tests at a real cluster")
    if os.environ.get("K8S_TEST_KUBECONFIG"):  # imported only then: it pulls in the k8s double's package
        from tests.k8s_double import target

        target.configure(config)  # a missing K8S_TEST_DRIVER_IMAGE ends the session here, saying so
    for name, value in UNPINNED_VLLM_ENV.items():
        os.environ.setdefault(name, value)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest files first, by their stored durations: xdist's loadfile hands whole files to its
    # workers in this order, so no long file runs alone at the end (tests/durations.py).
    durations.order(items)
    tiers.mark_units(items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Each xdist worker writes its own counts; the controller's are its workers' starts.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    starts.COUNTER.write(worker)
    if worker == "main":
        RECORDER.write(worker)  # the xdist controller sees every worker's reports: it writes them all
