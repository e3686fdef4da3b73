"""The cluster policy that queues batch runs earliest deadline first (scheduling/deadline_order.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from aibrix_operators.localenv import airflow_env
from aibrix_operators.scheduling import deadline_order

NOW = datetime(2026, 12, 2, 1, 0, tzinfo=UTC)


def _weight(task_id: str, conf: dict, run_after: datetime = NOW) -> int | None:
    ti = SimpleNamespace(task_id=task_id, priority_weight=None)
    deadline_order.task_instance_mutation_hook(ti, SimpleNamespace(conf=conf, run_after=run_after))
    return ti.priority_weight


def test_an_earlier_deadline_weighs_more_whatever_the_submission_time() -> None:
    tight = _weight("dispatch", {"completion_window": "30m"})
    moderate = _weight("dispatch", {"completion_window": "2h"})
    relaxed = _weight("dispatch", {})  # the pipeline's default window, 24h
    assert tight > moderate > relaxed
    # Submitted an hour later with a 10 m window: due at 02:10, before the 2 h batch (03:00)...
    assert _weight("dispatch", {"completion_window": "10m"}, NOW.replace(hour=2)) > moderate
    # ... and three hours later with 30 m: due at 04:30, after it.
    assert moderate > _weight("dispatch", {"completion_window": "30m"}, NOW.replace(hour=4)) > relaxed


def test_every_step_of_a_run_gets_the_run_weight_and_other_tasks_keep_theirs() -> None:
    conf = {"completion_window": "1h"}
    weights = {_weight(t, conf) for t in ("validate", "split", "dispatch", "merge", "batch.dispatch")}
    assert len(weights) == 1 and None not in weights
    assert _weight("report", conf) is None


def test_a_run_without_a_dag_run_or_with_a_bad_window_is_left_alone() -> None:
    ti = SimpleNamespace(task_id="dispatch", priority_weight=7)
    deadline_order.task_instance_mutation_hook(ti, None)
    assert ti.priority_weight == 7
    assert _weight("dispatch", {"completion_window": "soon"}) is None


def test_the_package_registers_no_policy_behind_the_deployments_back() -> None:
    # One registration, in the deployment's airflow_local_settings.py: an entry point too would
    # run the hook twice, and alone it is skipped when a run's task instances are created.
    assert [ep.value for ep in entry_points(group="airflow.policy")] == []


@pytest.mark.service
def test_airflow_registers_the_hook_from_the_deployments_local_settings(tmp_path) -> None:
    # A fresh process, as Airflow's components start, with the local stack's plugins folder
    # (where plugins/airflow_local_settings.py lies; the image copies it to $AIRFLOW_HOME/config).
    probe = (
        "from airflow import settings\n"
        "impls = settings.get_policy_plugin_manager().hook.task_instance_mutation_hook.get_hookimpls()\n"
        "print(settings.task_instance_mutation_hook.is_noop, sorted(h.function.__module__ for h in impls))\n"
    )
    env = {**airflow_env(tmp_path / "home"), "PATH": os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False ['aibrix_operators.scheduling.deadline_order']"
    # Without the local settings Airflow would skip the hook at run creation: the probe sees it.
    bare = {**env, "AIRFLOW__CORE__PLUGINS_FOLDER": str(tmp_path / "no-plugins")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=bare)
    assert out.stdout.strip().splitlines()[-1] == "True []", out.stderr[-2000:]
