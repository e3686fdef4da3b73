"""The suite's `dags test` server (dags_test_server.py): each run in a process of its own, forked
from one that has Airflow loaded, with exactly the request's environment and the command's status."""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.conftest import DAGS_TEST

pytestmark = pytest.mark.e2e


def test_each_run_sees_only_its_own_environment_and_gets_the_commands_status(airflow_session_env, tmp_path):
    with_var = {**airflow_session_env, "AIRFLOW_VAR_SERVER_PROBE": "from-run-one"}
    one = DAGS_TEST.run(["variables", "get", "server_probe"], with_var, tmp_path / "one", timeout_s=120)
    assert one.returncode == 0, one.stderr[-2000:]
    assert one.stdout.strip().splitlines()[-1] == "from-run-one"
    # The next run, without the variable: the first run's environment died with its process.
    two = DAGS_TEST.run(["variables", "get", "server_probe"], airflow_session_env, tmp_path / "two",
                        timeout_s=120)
    assert two.returncode != 0
    assert "server_probe" in two.stdout + two.stderr


def test_a_different_base_gets_its_own_server_and_a_stuck_run_is_killed(airflow_session_env, tmp_path):
    DAGS_TEST.run(["variables", "list"], airflow_session_env, tmp_path / "a", timeout_s=120)
    before = len(DAGS_TEST.servers)
    other = {**airflow_session_env, "AIRFLOW__CORE__PARALLELISM": "3"}
    seen = DAGS_TEST.run(["config", "get-value", "core", "parallelism"], other, tmp_path / "b", timeout_s=120)
    assert seen.returncode == 0 and seen.stdout.strip() == "3"
    assert len(DAGS_TEST.servers) == before + 1
    with pytest.raises(subprocess.TimeoutExpired):
        DAGS_TEST.run(["variables", "list"], other, tmp_path / "c", timeout_s=0.01)
    # The server is still there for the next run.
    again = DAGS_TEST.run(["config", "get-value", "core", "parallelism"], other, tmp_path / "d",
                          timeout_s=120)
    assert again.returncode == 0 and again.stdout.strip() == "3"
