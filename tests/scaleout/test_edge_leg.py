"""The multi-node tier on the EdgeExecutor (workers that reach the api-server over HTTP
only): two worker nodes, S3 the only shared storage (the cases:
leg_cases.py; the cluster: conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.conftest import airflow_session_env  # noqa: F401 - fixture
from tests.scaleout.conftest import Cluster, running_cluster
from tests.scaleout.leg_cases import (  # noqa: F401 - collected here
    test_a_batch_runs_through_both_worker_nodes_on_s3,
    test_a_worker_cut_off_mid_shard_pauses_and_loses_nothing,
    test_a_worker_node_lost_mid_shard_loses_and_repeats_nothing,
    test_batches_waiting_for_the_dispatch_pool_go_by_deadline,
    test_max_workers_waits_cost_no_try,
    test_the_scheduler_lost_mid_batch_leaves_running_tasks_running,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(airflow_session_env, tmp_path_factory) -> Iterator[Cluster]:  # noqa: F811
    with running_cluster("edge", airflow_session_env, tmp_path_factory.mktemp("edge-leg")) as running:
        yield running
