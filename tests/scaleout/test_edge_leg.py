"""The multi-node tier on the EdgeExecutor (workers that reach the api-server over HTTP
only): two worker nodes, S3 the only shared storage (the cases:
leg_cases.py; the cluster: conftest.py)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import airflow_session_env  # noqa: F401 - fixture
from tests.scaleout.leg_cases import *  # noqa: F403 - the cases every leg runs, collected here
from tests.scaleout.leg_cases import leg_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.waits]  # its own lane: docs/testing.md

cluster = leg_cluster("edge")
