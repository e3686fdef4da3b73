"""Shared by both test environments (orchestrator and inference): keep imports light."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    "integration/test_dag_kubernetes_scaling.py",
    "images/test_vllm_cpu_image.py",
    "integration/test_s3_dropzone.py",
    "driver/test_chaos.py",
    "integration/test_ui_trigger_browser.py",
    "integration/test_rest_api.py",
    "images/test_airflow_image.py",
)


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
