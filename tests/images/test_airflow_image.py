"""The Airflow image, built from inference_images/airflow/Dockerfile: every DAG imports, the
operators' package is the installed wheel, and the Batch API plugin answers on /openai/v1 in an
api-server started from the image."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from aibrix_operators.localenv import EXECUTOR
from aibrix_operators.scheduling.recovery import RECOVERY_ENV
from aibrix_operators.serving.local_vllm import free_port
from tests.images.containers import Detached, answers_200, inspect, last_error_line, run

pytestmark = [pytest.mark.e2e, pytest.mark.waits]  # its own lane: docs/testing.md

BASH = ["--entrypoint", "/bin/bash"]  # the stand-in base has no /entrypoint script of its own
EXPECTED_DAGS = {"batch_inference", "s3_dropzone", "nightly_eval__arithmetic", "aibrix_output_cleanup"}
# Which cluster policies Airflow registered, and whether it calls the mutation hook when a run's
# task instances are created (it skips a hook it marks a no-op).
POLICY_PROBE = (
    "from airflow import settings; "
    "impls = settings.get_policy_plugin_manager().hook.task_instance_mutation_hook.get_hookimpls(); "
    "print(settings.task_instance_mutation_hook.is_noop, sorted(h.function.__module__ for h in impls))"
)
RECOVERY_KEYS = [k.removeprefix("AIRFLOW__SCHEDULER__").lower() for k in RECOVERY_ENV]


@pytest.fixture(scope="module")
def inside(airflow_image):
    """What the image reports about itself: import errors, DAGs, plugins, the package's path."""
    script = (
        "set -e; airflow db migrate >/dev/null 2>&1; airflow dags reserialize >/dev/null 2>&1;"
        " echo '@@errors'; airflow dags list-import-errors -o json;"
        " echo '@@dags'; airflow dags list -o json;"
        " echo '@@plugins'; airflow plugins -o json;"
        " echo '@@package'; python -c 'import aibrix_operators, kvcache; print(aibrix_operators.__file__)';"
        " echo '@@recovery'; for key in " + " ".join(RECOVERY_KEYS) + "; do"
        " printf '%s=' $key; airflow config get-value scheduler $key 2>/dev/null | tail -1; done;"
        " echo '@@executor'; airflow config get-value core executor 2>/dev/null | tail -1;"
        " python -c 'from airflow.executors.executor_loader import ExecutorLoader as L;"
        " print(type(L.get_default_executor()).__name__)';"
        " echo '@@policy'; python -c '" + POLICY_PROBE + "'"
    )
    proc = run(airflow_image, "-c", script, flags=BASH, timeout=600)
    assert proc.returncode == 0, (
        f"airflow in the image failed: {last_error_line(proc)}\n{proc.stderr[-3000:]}"
    )
    sections, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("@@"):
            current = line[2:]
            sections[current] = []
        elif current:
            sections[current].append(line)
    return {key: "\n".join(lines) for key, lines in sections.items()}


def _json_tail(text: str):
    """The JSON document at the end of a CLI's output (Airflow logs warnings to stdout before it)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith(("[", "{")) and not lines[i].startswith("[warning"):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    raise AssertionError(f"no JSON at the end of:\n{text[-2000:]}")


def test_every_dag_imports_in_the_image(inside):
    errors = _json_tail(inside["errors"])
    assert errors == [], errors
    dags = {d["dag_id"] for d in _json_tail(inside["dags"])}
    assert EXPECTED_DAGS <= dags, dags


def test_the_plugin_and_the_installed_package_are_loaded(inside, airflow_image):
    plugins = {p["name"] for p in _json_tail(inside["plugins"])}
    assert "aibrix_batch_api" in plugins, inside["plugins"]
    assert re.search(r"/(site|dist)-packages/aibrix_operators/", inside["package"]), inside["package"]
    assert inspect(airflow_image, "{{.Config.User}}") in ("airflow", "50000")


def test_the_image_notices_a_lost_scheduler_within_a_minute(inside):
    # The values Airflow itself reads in the image, against the ones the tests run with.
    found = dict(line.split("=", 1) for line in inside["recovery"].splitlines() if "=" in line)
    assert found == {k: RECOVERY_ENV[f"AIRFLOW__SCHEDULER__{k.upper()}"] for k in RECOVERY_KEYS}


def test_the_image_runs_tasks_on_the_slot_keeping_executor(inside):
    # Named in the image's config, and the class Airflow's loader builds from that name.
    # Without the lines Airflow logs (timestamped) while loading it.
    lines = [line for line in inside["executor"].splitlines() if not re.match(r"\d{4}-\d\d-\d\dT", line)]
    assert lines == [EXECUTOR, "SlotKeepingLocalExecutor"], inside["executor"]


def test_the_image_registers_the_deadline_policy_through_local_settings(inside):
    # $AIRFLOW_HOME/config/airflow_local_settings.py, Airflow's own place for cluster policies.
    assert inside["policy"].splitlines()[-1] == "False ['aibrix_operators.scheduling.deadline_order']"


def test_the_batch_api_answers_in_an_api_server_from_the_image(airflow_image):
    port = free_port()
    script = f"airflow db migrate >/dev/null && exec airflow api-server --port {port} --host 127.0.0.1"
    # The API's storage is the deployment's setting (settings/locations.py): no folder of the image.
    flags = [*BASH, "-e", "AIRFLOW__API_AUTH__JWT_SECRET=image-smoke-test-secret",
             "-e", "AIRFLOW__AIBRIX_BATCH__API_STORAGE_ROOT=/tmp/batch-api"]
    with Detached(airflow_image, "-c", script, flags=flags) as server:
        base = f"http://127.0.0.1:{port}"

        server.wait_until(answers_200(base + "/api/v2/monitor/health"), 300, "api-server from the image")
        with urllib.request.urlopen(base + "/openai/openapi.json", timeout=10) as resp:
            schema = json.load(resp)
        assert "/v1/batches" in schema["paths"], sorted(schema["paths"])
        # No key: the Batch API itself refuses, in OpenAI's error shape (Airflow's own 404 for an
        # unmounted plugin would be {"detail": "Not Found"}).
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/openai/v1/batches", timeout=10)
        assert refused.value.code == 401
        assert json.load(refused.value)["error"]["type"]


def test_the_image_starts_as_a_celery_worker_and_as_an_edge_worker(airflow_image):
    """The shipped image is the workers' image too (docs/deploy.md's Helm values): `airflow celery
    worker` reaches a Redis broker and PostgreSQL and says it is ready; `airflow edge worker`
    registers with an api-server (also from the image) over HTTP alone."""
    from tests.integration.cluster_services import postgres, redis_broker

    with postgres() as db, redis_broker() as broker:
        common = ["-e", f"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN={db.url()}",
                  "-e", "AIRFLOW__API_AUTH__JWT_SECRET=image-worker-test-secret"]  # fmt: skip
        migrated = run(airflow_image, "-c", "airflow db migrate", flags=[*BASH, *common], timeout=600)
        assert migrated.returncode == 0, last_error_line(migrated)
        celery = [*BASH, *common, "-e", "AIRFLOW__CORE__EXECUTOR=CeleryExecutor",
                  "-e", f"AIRFLOW__CELERY__BROKER_URL={broker}",
                  "-e", f"AIRFLOW__CELERY__RESULT_BACKEND=db+{db.url()}",
                  "-e", "AIRFLOW__CELERY__WORKER_CONCURRENCY=1"]  # fmt: skip
        script = "exec airflow celery worker --without-mingle --without-gossip"
        with Detached(airflow_image, "-c", script, flags=celery) as worker:
            worker.wait_until(lambda: " ready." in worker.logs(), 300, "a Celery worker from the image")

        port = free_port()
        edge_env = ["-e", "AIRFLOW__CORE__EXECUTOR=airflow.providers.edge3.executors.EdgeExecutor",
                    "-e", "AIRFLOW__EDGE__API_ENABLED=True",
                    "-e", f"AIRFLOW__EDGE__API_URL=http://127.0.0.1:{port}/edge_worker/v1/rpcapi",
                    "-e", "AIRFLOW__API_AUTH__JWT_SECRET=image-worker-test-secret"]  # fmt: skip
        edge = [*BASH, "-e", f"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN={db.url()}", *edge_env]
        api = f"exec airflow api-server --port {port} --host 127.0.0.1"
        with Detached(airflow_image, "-c", api, flags=edge) as server:
            server.wait_until(answers_200(f"http://127.0.0.1:{port}/api/v2/monitor/health"), 300,
                              "api-server from the image")  # fmt: skip
            worker_flags = [*BASH, *edge_env]  # no database: the api-server is all an Edge worker reaches
            with Detached(airflow_image, "-c", "exec airflow edge worker --concurrency 1 --edge-hostname "
                          "image-edge", flags=worker_flags) as worker:  # fmt: skip
                import psycopg

                def registered() -> bool:
                    with psycopg.connect(db.url()) as conn:
                        rows = conn.execute("SELECT state FROM edge_worker WHERE worker_name = 'image-edge'")
                        return [r[0] for r in rows] in (["idle"], ["running"])

                worker.wait_until(registered, 300, "an Edge worker from the image registered")
