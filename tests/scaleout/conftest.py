"""A multi-node Airflow on one machine, on either executor that runs tasks on worker nodes:
the CeleryExecutor (a Redis broker) and the EdgeExecutor (workers that reach the api-server
over HTTP only), two worker nodes each.

The control node is the test's own network namespace: PostgreSQL (the metadata database, and
Celery's result backend), Redis (Celery's broker), SeaweedFS (S3, the only storage the nodes
share), the api-server, scheduler, dag-processor and triggerer, and the inference endpoint (the
raw OpenAI stub of tests/fake_openai.py, answering each request after a delay so shards take
seconds) — all listening on the bridge address. Each worker node (``netns.py``) runs ``airflow
celery worker`` or ``airflow edge worker`` with its own AIRFLOW_HOME, hostname and TMPDIR. Batches
read and write ``s3://`` only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from aibrix_operators.local_airflow import BIN, AirflowDeployment, start_airflow, wait_until
from aibrix_operators.serving.local_vllm import stop_process_group
from tests.integration.cluster_services import postgres, redis_broker
from tests.integration.services import S3Server, start_seaweedfs
from tests.scaleout.netns import Network, Node, network

REPO = Path(__file__).resolve().parents[2]
BUCKET = "scaleout"
WORKERS = ("worker1", "worker2")
# Each request is answered this long after it arrives: a shard of 120 at concurrency 4 takes ~8 s.
STUB_DELAY_S = 0.25
WORKER_CONCURRENCY = 2
# The dispatch tasks' pool (deploy.md: fewer slots than the workers' task slots, so waiting
# shards wait in the scheduler, ordered by deadline, not in the broker's queue).
DISPATCH_POOL, DISPATCH_SLOTS = "scaleout_dispatch", 3
# The CeleryExecutor's settings are docker-compose.yaml's own (the leg runs the compose stack's
# definitions, as its services would start): the executor, what a lost worker's message does
# (acknowledged when taken: never redelivered by the broker a day later; docs/multi-node.md),
# task_queued_timeout 120 s checked every 30 s (a message the lost worker had taken but not
# started runs again within 2.5 minutes, not Airflow's 10), and the result backend's driver.
COMPOSE_CELERY_KEYS = ("AIRFLOW__CORE__EXECUTOR", "AIRFLOW__CELERY__TASK_ACKS_LATE",
                       "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT",
                       "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL")  # fmt: skip


def compose_airflow_env() -> dict[str, str]:
    """The environment docker-compose.yaml gives every Airflow service (x-airflow-common)."""
    compose = yaml.safe_load((REPO / "docker-compose.yaml").read_text())
    return {key: str(value) for key, value in compose["x-airflow-common"]["environment"].items()}


def result_backend_driver() -> str:
    """The SQLAlchemy driver of compose's Celery result backend (``db+postgresql+<driver>://``)."""
    scheme = compose_airflow_env()["AIRFLOW__CELERY__RESULT_BACKEND"].split("://", 1)[0]
    return scheme.removeprefix("db+postgresql").removeprefix("+")


EXECUTOR_ENV = {
    "celery": {
        **{key: compose_airflow_env()[key] for key in COMPOSE_CELERY_KEYS},
        # The tier's own: two task slots a worker node (compose's workers have 8).
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(WORKER_CONCURRENCY),
    },
    "edge": {
        "AIRFLOW__CORE__EXECUTOR": "airflow.providers.edge3.executors.EdgeExecutor",
        "AIRFLOW__EDGE__API_ENABLED": "True",
        "AIRFLOW__EDGE__WORKER_CONCURRENCY": str(WORKER_CONCURRENCY),
        "AIRFLOW__EDGE__JOB_POLL_INTERVAL": "1",  # the default 5 s is a test's whole shard
        "AIRFLOW__EDGE__HEARTBEAT_INTERVAL": "10",
    },
}
# Edge workers sign their calls with it; every component of the deployment shares it.
JWT_SECRET = "scaleout-test-jwt-secret"


@dataclass
class Cluster:
    executor: str
    net: Network
    airflow: AirflowDeployment
    s3: S3Server
    stub_url: str
    broker_url: str
    workers: dict[str, Node]
    worker_logs: dict[str, Path]

    def stub_stats(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.stub_url + "/stats", timeout=10) as r:
            return json.loads(r.read())


def _start_stub(host: str, log: Path) -> tuple[subprocess.Popen, str]:
    code = ("import sys; from tests.fake_openai import RawStub, serve_raw; "
            f"RawStub.configure(None, {STUB_DELAY_S}); serve_raw(0, 1, {host!r})")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=open(log, "wb"), text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT "), f"the stub did not start: {log.read_text()[-2000:]}"
    return proc, f"http://{host}:{line.split()[1]}"


def _worker_ready(executor: str, log: Path) -> bool:
    text = log.read_text(errors="replace") if log.exists() else ""
    # Celery's "celery@worker1 ready."; an Edge worker's start (its registration is checked apart).
    return " ready." in text if executor == "celery" else "Starting worker with API endpoint" in text


def _worker_argv(executor: str, name: str) -> list[str]:
    if executor == "celery":
        return [str(BIN / "airflow"), "celery", "worker", "--without-mingle", "--without-gossip",
                "--celery-hostname", f"{name}@{name}"]  # fmt: skip
    return [str(BIN / "airflow"), "edge", "worker", "--concurrency", str(WORKER_CONCURRENCY),
            "--edge-hostname", name]  # fmt: skip


def _registered_edge_workers(db_url: str) -> set[str]:
    import psycopg

    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT worker_name FROM edge_worker WHERE state IN ('idle', 'running')")
        return {row[0] for row in rows}


@contextmanager
def running_cluster(executor: str, airflow_session_env: dict[str, str], root: Path) -> Iterator[Cluster]:
    """The control node's services and two worker nodes on ``executor``; all gone afterwards."""
    with network(list(WORKERS)) as net:
        ctl = net.control_address
        subnet = f"{ctl.rsplit('.', 1)[0]}.0/{net.prefix}"
        s3 = start_seaweedfs(root / "s3", "scaleout-key", "scaleout-secret", ip=ctl)
        stub, stub_url = _start_stub(ctl, root / "stub.log")
        try:
            with postgres(also_on=ctl, clients=subnet) as db, redis_broker(also_on=ctl) as broker:
                s3.client().create_bucket(Bucket=BUCKET)
                conn = s3.airflow_connection()
                home = root / "control"
                env = {**airflow_session_env, **EXECUTOR_ENV[executor], "AIRFLOW_HOME": str(home),
                       "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db.url(),
                       "AIRFLOW__CELERY__BROKER_URL": broker,
                       "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + db.url(result_backend_driver()),
                       "AIRFLOW__API_AUTH__JWT_SECRET": JWT_SECRET,
                       "AIRFLOW__AIBRIX_BATCH__DISPATCH_POOL": DISPATCH_POOL,
                       # Only what the nodes share: S3 in and out, the endpoint on the bridge.
                       "AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE": f"s3://{BUCKET}/",
                       "AIRFLOW__AIBRIX_BATCH__ALLOWED_ENDPOINTS": f"http://{ctl}:*",
                       "AIRFLOW__AIBRIX_BATCH__ALLOWED_AWS_CONN_IDS": "batch_s3",
                       "AIRFLOW__AIBRIX_BATCH__OUTPUT_ROOT": f"s3://{BUCKET}/runs",
                       "AIRFLOW_CONN_BATCH_S3": json.dumps(conn)}  # fmt: skip
                deployment = start_airflow(env, home, host=ctl)
                set_pool(deployment, DISPATCH_SLOTS)
                edge_api = f"{deployment.api_url}/edge_worker/v1/rpcapi"
                worker_env = {**deployment.env, "AIRFLOW__EDGE__API_URL": edge_api}
                if executor == "edge":  # no database on an Edge worker: the api-server is all it reaches
                    worker_env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
                logs: dict[str, Path] = {}
                try:
                    for name in WORKERS:
                        logs[name] = root / name / "worker.log"
                        node_env = {**worker_env, "AIRFLOW_HOME": str(root / name)}
                        net.nodes[name].start(_worker_argv(executor, name), node_env, logs[name])
                    for name in WORKERS:
                        wait_until(lambda n=name: _worker_ready(executor, logs[n]), 180,
                                   f"{executor} worker on {name}")  # fmt: skip
                    if executor == "edge":
                        wait_until(lambda: _registered_edge_workers(db.url()) == set(WORKERS), 60,
                                   "both edge workers registered")  # fmt: skip
                    yield Cluster(executor, net, deployment, s3, stub_url, broker,
                                  {n: net.nodes[n] for n in WORKERS}, logs)  # fmt: skip
                finally:
                    for node in net.nodes.values():
                        node.lose()
                    deployment.stop()
        finally:
            stop_process_group(stub)
            stop_process_group(s3.proc)


def set_pool(deployment: AirflowDeployment, slots: int) -> None:
    token = deployment.token()
    try:
        body = {"pool": DISPATCH_POOL, "slots": slots, "include_deferred": False}
        deployment.api("PATCH", f"/api/v2/pools/{DISPATCH_POOL}", body, token)
    except AssertionError as exc:
        if "-> 404" not in str(exc):
            raise
        deployment.api("POST", "/api/v2/pools", {"name": DISPATCH_POOL, "slots": slots}, token)


def wait_for(check, timeout_s: float, what: str, every_s: float = 0.5):
    """Poll ``check`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not after {timeout_s}s")
