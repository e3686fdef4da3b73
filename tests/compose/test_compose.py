"""docker-compose.yaml (Docker cannot run here): structure, pins, healthchecks, start order,
loopback ports, no hard-coded secrets, and every Dockerfile and mounted path exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from aibrix_operators.localenv import EXECUTOR

REPO = Path(__file__).resolve().parents[2]
ONE_SHOT = {"airflow-init", "s3-init", "models"}  # run to completion; others wait for success


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())  # resolves the << merges


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def test_the_stack_is_complete(services):
    assert {"postgres", "airflow-api-server", "airflow-scheduler", "airflow-dag-processor",
            "airflow-triggerer", "airflow-worker", "broker", "seaweedfs", "s3-init", "vllm", "vllm-gpu",
            "redis", "prometheus", "grafana", "pushgateway"} <= set(services)
    assert services["vllm-gpu"]["profiles"] == ["gpu"]
    airflow = services["airflow-scheduler"]["environment"]
    # The driver our pins install (requirements.txt: psycopg 3, SQLAlchemy 2.1's default), and
    # the async one Airflow derives for any PostgreSQL database: both load here.
    conn = airflow["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    url = make_url(re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", conn))  # the compose default password
    async_url = url.set(drivername="postgresql+asyncpg")
    assert (url.drivername, url.get_dialect().driver, async_url.get_dialect().driver) == (
        "postgresql+psycopg", "psycopg", "asyncpg")
    url.get_dialect().import_dbapi()  # installed: ImportError otherwise
    async_url.get_dialect().import_dbapi()
    assert all(s.get("command") != ["standalone"] for s in services.values())


def test_the_stack_runs_airflow_on_celery_as_the_multi_node_tier_does(services):
    """Two Celery workers, their own Redis broker, results in PostgreSQL through a driver our pins
    install, and the dispatch pool made at init. The Celery leg (tests/scaleout/) starts its
    Airflow with this file's executor settings, so the tier tests these definitions."""
    from tests.scaleout.conftest import EXECUTOR_ENV, result_backend_driver

    airflow = services["airflow-scheduler"]["environment"]
    assert airflow["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor" != EXECUTOR  # make run keeps Local
    worker = services["airflow-worker"]
    assert worker["command"] == ["celery", "worker"] and worker["deploy"]["replicas"] == 2
    assert worker["environment"] == airflow  # one definition for every Airflow service
    assert airflow["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://broker:")
    assert "--appendonly" in services["broker"]["command"]  # queued tasks survive a broker restart
    backend = make_url(re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1",
                              airflow["AIRFLOW__CELERY__RESULT_BACKEND"].removeprefix("db+")))
    backend.get_dialect().import_dbapi()
    assert backend.get_dialect().driver == result_backend_driver() == "psycopg"
    assert airflow["AIRFLOW__CELERY__TASK_ACKS_LATE"] == "False"
    for key, value in EXECUTOR_ENV["celery"].items():
        if key != "AIRFLOW__CELERY__WORKER_CONCURRENCY":  # the tier's nodes are smaller
            assert airflow[key] == value, key
    pool = airflow["AIRFLOW__AIBRIX_BATCH__DISPATCH_POOL"]
    init = services["airflow-init"]["command"][-1]
    slots = int(re.search(rf"airflow pools set {pool} (\d+) ", init)[1])
    # Fewer slots than the workers' task slots: waiting shards wait in the scheduler (deadline order).
    assert slots < worker["deploy"]["replicas"] * int(airflow["AIRFLOW__CELERY__WORKER_CONCURRENCY"])


def test_every_image_is_pinned_or_built_here(services):
    for name, svc in services.items():
        if "build" in svc:
            dockerfile = REPO / svc["build"].get("context", ".") / svc["build"]["dockerfile"]
            assert dockerfile.is_file(), (name, dockerfile)
            args = svc["build"].get("args") or {}
            for line in dockerfile.read_text().splitlines():
                if line.startswith(("FROM", "ARG")) and ":" in line:
                    overridden = line.startswith("ARG") and line.split()[1].split("=")[0] in args
                    assert overridden or not line.rstrip().endswith(":latest"), (name, line)
            for arg in args.values():
                assert not str(arg).endswith(":latest"), (name, arg)
            continue
        repo, _, tag = svc["image"].rpartition(":")
        assert repo and re.search(r"\d", tag) and tag != "latest", (name, svc["image"])  # a version


def test_healthchecks_and_start_order(services):
    for name, svc in services.items():
        if name in ONE_SHOT:
            assert svc.get("restart") == "no", name
            continue
        assert "healthcheck" in svc and svc["healthcheck"]["test"], name
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must name conditions"
        for dep, cond in deps.items():
            assert dep in services, (name, dep)
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert cond == {"condition": want}, (name, dep, cond)
    order = services["airflow-scheduler"]["depends_on"]
    assert {"postgres", "airflow-init", "vllm", "s3-init"} <= set(order)
    assert set(services["vllm"]["depends_on"]) >= {"models", "redis"}


def test_ports_bind_to_loopback(services):
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_no_hard_coded_secrets(services):
    secret_key = re.compile(r"(PASSWORD|SECRET|ACCESS_KEY)", re.I)
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if secret_key.search(key):
                assert re.fullmatch(r"\$\{\w+:-local-dev[\w-]*\}", str(value)), (name, key, value)
        conn = (svc.get("environment") or {}).get("AIRFLOW_CONN_AWS_DEFAULT")
        if conn:
            assert "${S3_SECRET_KEY:-local-dev-secret}" in conn


def test_mounted_repo_paths_exist(services):
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), (name, source)
