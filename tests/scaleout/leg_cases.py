"""The pipeline across two worker nodes, S3 the only shared storage: the cases every leg runs
(test_celery_leg.py, test_edge_leg.py; issue 37's multi-node tier; the clusters: conftest.py).
Not collected here: each leg's module imports them (``__all__``) beside its own ``cluster``
fixture (``leg_cluster``), so the two legs are two files the parallel pass can put on two workers."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from aibrix_operators.local_airflow import trigger_and_wait
from tests.scaleout.conftest import (
    BUCKET,
    DISPATCH_SLOTS,
    STUB_DELAY_S,
    WORKERS,
    Cluster,
    running_cluster,
    set_pool,
    wait_for,
)

# The cases a leg collects with ``from tests.scaleout.leg_cases import *``: a new case is listed
# once, here, and both legs run it.
__all__ = [
    "test_a_batch_runs_through_both_worker_nodes_on_s3",
    "test_a_worker_cut_off_mid_shard_pauses_and_loses_nothing",
    "test_a_worker_node_lost_mid_shard_loses_and_repeats_nothing",
    "test_batches_waiting_for_the_dispatch_pool_go_by_deadline",
    "test_max_workers_waits_cost_no_try",
    "test_the_scheduler_lost_mid_batch_leaves_running_tasks_running",
]

CONCURRENCY = 4


def leg_cluster(executor: str) -> Any:
    """The module-scoped ``cluster`` fixture of the leg that runs ``executor`` ("celery", "edge")."""

    @pytest.fixture(scope="module")
    def cluster(airflow_session_env, tmp_path_factory) -> Iterator[Cluster]:
        work = tmp_path_factory.mktemp(f"{executor}-leg")
        with running_cluster(executor, airflow_session_env, work) as running:
            yield running

    return cluster


def requests_file(cluster: Cluster, key: str, n: int) -> tuple[str, list[str]]:
    ids = [f"req-{i:05d}" for i in range(n)]
    body = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "messages": [{"role": "user", "content": cid}],
                                        "max_tokens": 8}}) + "\n" for cid in ids)  # fmt: skip
    cluster.s3.client().put_object(Bucket=BUCKET, Key=key, Body=body.encode())
    return f"s3://{BUCKET}/{key}", ids


def conf(cluster: Cluster, input_uri: str, out: str, per_shard: int) -> dict:
    return {"input_uri": input_uri, "output_uri": f"s3://{BUCKET}/{out}", "endpoint": cluster.stub_url,
            "aws_conn_id": "batch_s3", "requests_per_shard": per_shard, "concurrency": CONCURRENCY}


def output_ids(cluster: Cluster, out: str) -> list[str]:
    body = cluster.s3.client().get_object(Bucket=BUCKET, Key=f"{out}/output.jsonl")["Body"].read()
    return [json.loads(line)["custom_id"] for line in body.splitlines()]


def submit(cluster: Cluster, conf: dict) -> str:
    token = cluster.airflow.token()
    cluster.airflow.api("PATCH", "/api/v2/dags/batch_inference", {"is_paused": False}, token)
    run = cluster.airflow.api("POST", "/api/v2/dags/batch_inference/dagRuns",
                              {"logical_date": None, "conf": conf}, token)  # fmt: skip
    return run["dag_run_id"]


def finished(cluster: Cluster, run_id: str, timeout_s: float = 600) -> None:
    """Wait for the run to end; fail with its failed tasks' logs unless it succeeded."""
    path = f"/api/v2/dags/batch_inference/dagRuns/{run_id}"
    run = wait_for(lambda: (r := cluster.airflow.api("GET", path))["state"] in ("success", "failed") and r,
                   timeout_s, f"run {run_id}", every_s=2)  # fmt: skip
    assert run["state"] == "success", cluster.airflow.failure_report("batch_inference", run_id)


def dispatch_working(cluster: Cluster, run_id: str) -> dict | None:
    running = [t for t in task_instances(cluster, run_id)
               if t["task_id"] == "dispatch" and t["state"] == "running" and t["hostname"] in WORKERS]
    return running[0] if running else None


def task_instances(cluster: Cluster, run_id: str) -> list[dict]:
    path = f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances?limit=100"
    return cluster.airflow.api("GET", path, token=cluster.airflow.token())["task_instances"]


def test_a_batch_runs_through_both_worker_nodes_on_s3(cluster: Cluster):
    input_uri, ids = requests_file(cluster, "in/both.jsonl", 160)
    run = trigger_and_wait(cluster.airflow, "batch_inference",
                           conf(cluster, input_uri, "out/both", 40), timeout_s=600)  # fmt: skip
    report = cluster.airflow.failure_report
    assert run["state"] == "success", report("batch_inference", run["dag_run_id"])
    assert output_ids(cluster, "out/both") == ids  # every id once, in input order
    tis = task_instances(cluster, run["dag_run_id"])
    # Four shards at two task slots a node: both nodes ran dispatches, each its own hostname.
    dispatch_hosts = {t["hostname"] for t in tis if t["task_id"] == "dispatch"}
    assert dispatch_hosts == set(WORKERS), dispatch_hosts
    assert all(t["try_number"] == 1 for t in tis if t["state"] == "success"), tis
    # Nothing ran in the scheduler: each task instance was a message (Celery) or a job (Edge) the
    # workers took.
    ran = [t for t in tis if t["state"] == "success"]
    taken = "execute_workload[" if cluster.executor == "celery" else "Received job:"
    received = sum(log.read_text(errors="replace").count(taken) for log in cluster.worker_logs.values())
    assert received >= len(ran), (received, [t["task_id"] for t in ran])


def test_a_worker_node_lost_mid_shard_loses_and_repeats_nothing(cluster: Cluster):
    """Everything on the node running a shard is killed at once; the scheduler notices the
    missing heartbeat, the retry runs on the other node and resumes from the shard's
    checkpoints: every id once, in order, and only what was in flight is sent again."""
    n, per_shard = 240, 120
    input_uri, ids = requests_file(cluster, "in/lost.jsonl", n)
    before = cluster.stub_stats()["requests"]
    token = cluster.airflow.token()
    cluster.airflow.api("PATCH", "/api/v2/dags/batch_inference", {"is_paused": False}, token)
    run = cluster.airflow.api("POST", "/api/v2/dags/batch_inference/dagRuns", {
        "logical_date": None, "conf": conf(cluster, input_uri, "out/lost", per_shard)}, token)
    run_id = run["dag_run_id"]

    def a_dispatch_working() -> dict | None:
        running = [t for t in task_instances(cluster, run_id)
                   if t["task_id"] == "dispatch" and t["state"] == "running" and t["hostname"] in WORKERS]
        return running[0] if running else None

    victim = wait_for(a_dispatch_working, 300, "a dispatch running on a worker node")
    time.sleep(3 * STUB_DELAY_S * per_shard / CONCURRENCY / 10)  # a few seconds into the shard
    node = cluster.workers[victim["hostname"]]
    lost_at = node.lose()
    deadline = time.monotonic() + 600
    while run["state"] not in ("success", "failed") and time.monotonic() < deadline:
        time.sleep(2)
        run = cluster.airflow.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}", token=token)
    assert run["state"] == "success", cluster.airflow.failure_report("batch_inference", run_id)
    assert output_ids(cluster, "out/lost") == ids  # 0 lost, 0 duplicated, in order

    retried = next(t for t in task_instances(cluster, run_id)
                   if t["task_id"] == "dispatch" and t["map_index"] == victim["map_index"])
    assert retried["try_number"] == 2 and retried["hostname"] != victim["hostname"], retried
    resumed_at = datetime.fromisoformat(retried["start_date"]).timestamp()
    recovery_s = resumed_at - lost_at
    sent = cluster.stub_stats()["requests"] - before
    resent = sent - n
    print(f"worker node lost: retry started {recovery_s:.1f}s after the kill; {resent} answers sent again")
    # In flight at the kill plus what one checkpoint flush (1 s) covers at the stub's rate, and
    # the driver's health probe replays (a handful).
    assert 0 <= resent <= CONCURRENCY + CONCURRENCY / STUB_DELAY_S + 8, resent
    # Issue 37's bound: the heartbeat timeout (40 s) + its detection interval (5 s) + the retry
    # delay (5 s), with the scheduler's loop to spare.
    assert recovery_s <= 60, recovery_s
    if cluster.executor == "celery":
        # The dead worker's message is not waiting in the broker to be delivered again (a day
        # later, at Celery's visibility timeout): it was acknowledged when the worker took it.
        import redis

        unacked = redis.Redis.from_url(cluster.broker_url).hlen("unacked")
        assert unacked == 0, f"{unacked} unacknowledged message(s) in Redis after the node was lost"


def test_max_workers_waits_cost_no_try(cluster: Cluster):
    """Three shards, two at a time: the third waits for a turn by rescheduling. On every
    executor, no wait may cost a try (apache/airflow#71172: a stale success read after the task is queued
    again fails it as "killed externally"): every dispatch ends on its first try."""
    input_uri, ids = requests_file(cluster, "in/turns.jsonl", 120)
    run_id = submit(cluster, {**conf(cluster, input_uri, "out/turns", 40), "max_workers": 2})
    finished(cluster, run_id)
    assert output_ids(cluster, "out/turns") == ids
    dispatch = sorted((t for t in task_instances(cluster, run_id) if t["task_id"] == "dispatch"),
                      key=lambda t: t["map_index"])  # fmt: skip
    assert [t["map_index"] for t in dispatch] == [0, 1, 2]
    assert [t["try_number"] for t in dispatch] == [1, 1, 1], dispatch
    # The scheduler's log is the module's: only this run's lines count (a lost node's task is
    # rightly "killed externally" in another test).
    log = (cluster.airflow.home / "component-logs" / "scheduler.log").read_text(errors="replace")
    assert not [line for line in log.splitlines() if "state attribute is" in line and run_id in line]


def test_batches_waiting_for_the_dispatch_pool_go_by_deadline(cluster: Cluster):
    """Three batches arrive latest deadline first while the dispatch pool has no free slot (closed:
    0 slots); once all three dispatches wait, it opens one slot, and the scheduler hands it out by
    the deadline weights: tight, moderate, relaxed (the broker's queue is first in, first out, so
    the pool is the bound that must bind: docs/scheduling.md). Closing the pool instead of holding
    it with a long shard: the three must be waiting when it frees, whatever the machine's load."""
    set_pool(cluster.airflow, 0)
    try:
        runs = {}
        for name, window in (("relaxed", "24h"), ("moderate", "2h"), ("tight", "20m")):
            uri, _ = requests_file(cluster, f"in/{name}.jsonl", 8)
            runs[name] = submit(cluster, {**conf(cluster, uri, f"out/{name}", 8),
                                          "completion_window": window})  # fmt: skip

        def all_waiting() -> bool:  # each run's dispatch scheduled, waiting for the slot
            return all(any(t["task_id"] == "dispatch" and t["state"] == "scheduled"
                           for t in task_instances(cluster, run_id)) for run_id in runs.values())

        wait_for(all_waiting, 600, "three dispatches waiting for the pool")
        set_pool(cluster.airflow, 1)
        for run_id in runs.values():
            finished(cluster, run_id)
    finally:
        set_pool(cluster.airflow, DISPATCH_SLOTS)
    started = {name: next(t["start_date"] for t in task_instances(cluster, run_id)
                          if t["task_id"] == "dispatch") for name, run_id in runs.items()}  # fmt: skip
    assert sorted(started, key=started.get) == ["tight", "moderate", "relaxed"], started


def test_the_scheduler_lost_mid_batch_leaves_running_tasks_running(cluster: Cluster):
    """The tasks run on the workers: a scheduler killed mid-shard and started again adopts them
    (Celery's and Edge's executors both can); nothing is retried, lost or answered twice."""
    input_uri, ids = requests_file(cluster, "in/sched.jsonl", 240)
    before = cluster.stub_stats()["requests"]
    run_id = submit(cluster, conf(cluster, input_uri, "out/sched", 120))
    wait_for(lambda: dispatch_working(cluster, run_id), 300, "a dispatch running on a worker node")
    cluster.airflow.lose("scheduler")
    time.sleep(5)
    cluster.airflow.restart("scheduler")
    finished(cluster, run_id)
    assert output_ids(cluster, "out/sched") == ids
    tis = task_instances(cluster, run_id)
    assert all(t["try_number"] == 1 for t in tis if t["state"] == "success"), tis
    assert cluster.stub_stats()["requests"] - before <= len(ids) + 8  # health probes at most


@pytest.mark.parametrize("cut_from", ["endpoint", "s3"])
def test_a_worker_cut_off_mid_shard_pauses_and_loses_nothing(cluster: Cluster, cut_from: str):
    """The node running a shard loses its route to the endpoint, or to S3, for 30 s (its packets
    there dropped, as a partition does): the shard stalls and goes on; no request fails, no
    error line, nothing retried."""
    out = f"out/cut-{cut_from}"
    input_uri, ids = requests_file(cluster, f"in/cut-{cut_from}.jsonl", 240)
    before = cluster.stub_stats()["requests"]
    run_id = submit(cluster, conf(cluster, input_uri, out, 240))
    working = wait_for(lambda: dispatch_working(cluster, run_id), 300, "the dispatch running")
    # Mid-shard: a sixth of the requests answered (before that, preflight would wait it out).
    wait_for(lambda: cluster.stub_stats()["requests"] - before >= 40, 120, "the shard sending")
    node = cluster.workers[working["hostname"]]
    target = cluster.stub_url if cut_from == "endpoint" else cluster.s3.endpoint
    host, port = target.removeprefix("http://").rsplit(":", 1)
    rule = ["OUTPUT", "-d", host, "-p", "tcp", "--dport", port, "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", node.netns, "iptables", "-A", *rule], check=True)
    try:
        time.sleep(30)
    finally:
        subprocess.run(["ip", "netns", "exec", node.netns, "iptables", "-D", *rule], check=True)
    finished(cluster, run_id)
    assert output_ids(cluster, out) == ids
    client = cluster.s3.client()
    batch = json.loads(client.get_object(Bucket=BUCKET, Key=f"{out}/batch.json")["Body"].read())
    assert batch["request_counts"] == {"total": 240, "completed": 240, "failed": 0}, batch
    assert client.get_object(Bucket=BUCKET, Key=f"{out}/errors.jsonl")["Body"].read() == b""
    (dispatch,) = [t for t in task_instances(cluster, run_id) if t["task_id"] == "dispatch"]
    assert dispatch["try_number"] == 1, dispatch
    outcome = cluster.airflow.api(
        "GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances/dispatch/xcomEntries/"
        "return_value?map_index=0")["value"]  # fmt: skip
    print(f"cut off from {cut_from} for 30 s on {node.name}: the shard's outcome {outcome}")
    # The shard waited out the cut (15 s of work took 40 s or more) and lost nothing: the dropped
    # packets were sent again when the route came back, before any timeout, so nothing failed.
    assert outcome["elapsed_s"] >= 15 + 25 and outcome["failed"] == 0 and outcome["completed"] == 240, outcome
