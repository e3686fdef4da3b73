"""batch_inference on the Helm chart's default Airflow: the CeleryExecutor on PostgreSQL.

Every component is real and separate: PostgreSQL as the metadata database and Celery's result
backend, redis-server as the broker, the api-server, scheduler, dag-processor and triggerer, and
an ``airflow celery worker`` that runs the tasks (nothing runs in the scheduler). It is what our
pins could not start before (issue 37): ``airflow db migrate`` needs both PostgreSQL drivers
(asyncpg, psycopg 3), and celery 5.7 crashes the provider.
"""

from __future__ import annotations

import subprocess

import pytest

from aibrix_operators.local_airflow import BIN, start_airflow, trigger_and_wait
from tests.integration.cluster_services import postgres, redis_broker
from tests.integration.conftest import SERVED_NAME, chat_requests, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def celery_airflow(airflow_session_env, tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-celery")
    with postgres() as db, redis_broker() as broker:
        env = {**airflow_session_env, "AIRFLOW_HOME": str(home),
               "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
               "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db.url(),
               "AIRFLOW__CELERY__BROKER_URL": broker,
               "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + db.url(),
               "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4"}
        deployment = start_airflow(env, home)  # `airflow db migrate` on PostgreSQL first
        log = home / "component-logs" / "celery-worker.log"
        with open(log, "ab") as out:
            worker = subprocess.Popen([str(BIN / "airflow"), "celery", "worker", "--without-mingle",
                                       "--without-gossip"], env=deployment.env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deployment.procs.append(worker)  # stopped with the others
        try:
            yield deployment, log
        finally:
            deployment.stop()


def test_a_batch_runs_on_celery_workers_with_postgresql(celery_airflow, vllm_chat, tmp_path):
    deployment, worker_log = celery_airflow
    requests = chat_requests(12)
    out = tmp_path / "out"
    run = trigger_and_wait(deployment, "batch_inference", {
        "input_uri": str(write_jsonl(tmp_path / "input.jsonl", requests)), "output_uri": str(out),
        "endpoint": vllm_chat.base_url, "model": SERVED_NAME, "requests_per_shard": 5,
    }, timeout_s=600)
    assert run["state"] == "success", deployment.failure_report("batch_inference", run["dag_run_id"])
    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]  # each once, in order

    # The tasks ran on the Celery worker, taken from the broker: one received per task instance.
    tis = deployment.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run['dag_run_id']}"
                                "/taskInstances?limit=100")["task_instances"]
    ran = [t for t in tis if t["state"] == "success"]
    assert any(t["task_id"] == "dispatch" for t in ran) and all(t["queue"] == "default" for t in ran)
    received = worker_log.read_text(errors="replace").count("execute_workload[")
    assert received >= len(ran), (received, [t["task_id"] for t in ran])
