"""The Airflow image, built from inference_images/airflow/Dockerfile: every DAG imports, the
operators' package is the installed wheel, and the Batch API plugin answers on /openai/v1 in an
api-server started from the image."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from aibrix_operators.airflow_recovery import RECOVERY_ENV
from aibrix_operators.localenv import EXECUTOR
from aibrix_operators.serving.local_vllm import free_port
from tests.images.containers import Detached, answers_200, inspect, last_error_line, run

pytestmark = pytest.mark.e2e

BASH = ["--entrypoint", "/bin/bash"]  # the stand-in base has no /entrypoint script of its own
EXPECTED_DAGS = {"batch_inference", "s3_dropzone", "nightly_eval__arithmetic"}
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
        " print(type(L.get_default_executor()).__name__)'"
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
