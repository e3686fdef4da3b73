"""Shared by both test environments (orchestrator and inference): keep imports light."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import durations, starts, tiers
from tests.tiers import pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401 - hooks

REPO_ROOT = Path(__file__).resolve().parents[1]

# The longest modules (minutes each, measured with --durations), longest first. pytest-xdist's
# --dist loadfile hands whole files to its workers in collection order, so starting these
# first keeps one long file from running alone at the end while the other worker idles. Only
# the order depends on this list (a stale entry costs balance, never a test).
LONGEST_FIRST = (
    "integration/test_batch_api.py",
    "integration/test_failures_and_trust.py",
    "integration/test_nightly_eval.py",
    "integration/test_dag_kubernetes.py",
    "integration/test_endpoints_e2e.py",
    "integration/test_prefix_grouping_e2e.py",
    "integration/test_dag_local.py",
    "integration/test_scheduler_loss.py",
    "integration/test_embeddings.py",
    "integration/test_lora_dag.py",
    "integration/test_nightly_eval_adapter.py",
    "integration/test_dag_kubernetes_scaling.py",
    "images/test_vllm_cpu_image.py",
    "integration/test_s3_dropzone.py",
    "driver/test_chaos.py",
    "integration/test_ui_trigger_browser.py",
    "integration/test_rest_api.py",
    "images/test_airflow_image.py",
    # The inference suite (its own run): files whose module fixtures start vLLM servers.
    "kvcache/test_kvcache_vllm.py",
    "kvcache/test_kvcache_pd.py",
    "kvcache/test_router_pd.py",
    "kvcache/test_kvcache_shared_l2.py",
    "kvcache/test_kvcache_lora.py",
    "kvcache/test_kvcache_prefix_replicas.py",
)

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
RECORDER = durations.Recorder()

UNPINNED_VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def pytest_configure(config: pytest.Config) -> None:
    tiers.configure(config)
    starts.install()
    config.pluginmanager.register(RECORDER, "aibrix-durations")
    for name, value in UNPINNED_VLLM_ENV.items():
        os.environ.setdefault(name, value)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests_dir = REPO_ROOT / "tests"

    def key(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(tests_dir).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(name, len(rank))

    items.sort(key=key)  # stable: within a file, and among the rest, pytest's own order
    tiers.mark_units(items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Each xdist worker writes its own counts; the controller's are its workers' starts.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    starts.COUNTER.write(worker)
    if worker == "main":
        RECORDER.write(worker)  # the xdist controller sees every worker's reports: it writes them all
