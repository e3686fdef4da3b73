"""What a deferred ``AIBrixBatchOperator`` costs the api-server while its batch runs.

A deferred operator holds no worker slot: its ``BatchApiTrigger`` waits in the triggerer and
polls ``GET /v1/batches/{id}`` with backoff (every 5 s at first, each wait 1.5 times the last,
at most one a minute). This bench runs ``--waiting`` of those triggers (the class the triggerer
runs, with its defaults, through an ``aibrix_batch`` connection) on one asyncio loop, as a
triggerer would, against a real deployment (bench/batch_api.py's: api-server, scheduler,
SeaweedFS S3 storage root) while one batch stays *in progress* throughout (5,000 requests at
concurrency 4 against a stub endpoint answering after 1 s, so every poll reads live counts from
the drivers' checkpoints). It reports the api-server process tree's CPU time (/proc
utime+stime) over ``--window-s`` seconds, net of its idle rate measured right after, as a share
of one core per waiting batch: over the window (the backoff's ramp included, its costliest part)
and at the steady one-poll-a-minute rate (the net CPU per poll over 60 s).

    .venv/bin/python bench/deferred_wait.py --json /tmp/deferred_wait.json     # ~6 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "plugins"))

from cli_client import cpu_seconds  # noqa: E402

IDLE_S = 60.0


@contextmanager
def counting_polls() -> Iterator[list[int]]:
    """Counts the batch objects the triggers' SDK calls receive (``AsyncBatches.retrieve``, what
    ``BatchApiTrigger`` polls with): the one-element list holds the count."""
    from openai.resources.batches import AsyncBatches

    count = [0]
    original = AsyncBatches.retrieve

    async def retrieve(self: AsyncBatches, *args: Any, **kwargs: Any) -> Any:
        batch = await original(self, *args, **kwargs)
        count[0] += 1
        return batch

    AsyncBatches.retrieve = retrieve  # type: ignore[method-assign]
    try:
        yield count
    finally:
        AsyncBatches.retrieve = original  # type: ignore[method-assign]


async def wait_deferred(batch_id: str, waiting: int, window_s: float) -> int:
    """``waiting`` triggers on one loop for ``window_s``; none may fire (the batch runs on).
    Returns how many polls they made."""
    from aibrix_operators.triggers.batch_api import BatchApiTrigger

    async def one(trigger: BatchApiTrigger) -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    with counting_polls() as polls:
        tasks = [asyncio.create_task(one(BatchApiTrigger(batch_id))) for _ in range(waiting)]
        done, _ = await asyncio.wait(tasks, timeout=window_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    fired = [t.result() for t in done if not t.cancelled()]
    assert not fired, f"a trigger fired inside the window: {fired[:1]}"
    return polls[0]


def measure(work: Path, waiting: int, window_s: float) -> dict:
    import batch_api as deployment  # bench/batch_api.py: the deployment its bench measures

    dep = deployment.start(work, stub_delay=1.0, dag_conf={"requests_per_shard": 5000, "concurrency": 4})
    try:
        dep.set_paused(False)  # the deployment starts with batch_inference paused
        client = dep.client()
        batch_file = work / "wait.jsonl"
        deployment.write_batch_file(batch_file, requests=5000)
        with open(batch_file, "rb") as fh:
            file_id = client.files.create(file=fh, purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 300
        while (current := client.batches.retrieve(batch.id)).request_counts.completed == 0:
            assert current.status in ("validating", "in_progress") and time.monotonic() < deadline, current
            time.sleep(1)
        # The connection the operator's task and its trigger read (tenant key as the password).
        os.environ["AIRFLOW_CONN_AIBRIX_BATCH_DEFAULT"] = json.dumps(
            {"conn_type": "aibrix_batch", "host": dep.airflow.api_url, "password": dep.key})
        pids = deployment.process_tree(dep.airflow.procs[0].pid)

        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        polls = asyncio.run(wait_deferred(batch.id, waiting, window_s))
        busy_cpu, busy_wall = cpu_seconds(pids) - cpu0, time.perf_counter() - t0
        cpu1 = cpu_seconds(pids)
        time.sleep(IDLE_S)
        idle_rate = (cpu_seconds(pids) - cpu1) / IDLE_S
        status = client.batches.retrieve(batch.id)
        assert status.status == "in_progress", status.status  # in progress throughout
        client.batches.cancel(batch.id)

        net_cpu = busy_cpu - idle_rate * busy_wall
        per_poll = net_cpu / max(polls, 1)
        return {
            "waiting": waiting, "window_s": busy_wall, "polls": polls,
            "busy_cpu_s": busy_cpu, "idle_cpu_per_s": idle_rate, "net_cpu_s": net_cpu,
            "net_cpu_per_poll_ms": per_poll * 1000,
            "core_pct_per_waiting_batch_window": net_cpu / busy_wall / waiting * 100,
            "core_pct_per_waiting_batch_steady": per_poll / 60.0 * 100,
            "answered_at_end": status.request_counts.completed,
        }
    finally:
        deployment.stop(dep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waiting", type=int, default=50, help="deferred operators (triggers) waiting at once")
    p.add_argument("--window-s", type=float, default=180.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    logging.disable(logging.INFO)  # a line per poll from the triggers and their HTTP client
    (REPO / ".work").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-deferred-", dir=REPO / ".work") as tmp:
        result = measure(Path(tmp), args.waiting, args.window_s)
    print(f"{result['waiting']} deferred batches for {result['window_s']:.0f} s: {result['polls']} polls, "
          f"api-server {result['busy_cpu_s']:.2f} s CPU (idle {result['idle_cpu_per_s'] * 1000:.1f} ms/s) "
          f"= {result['net_cpu_per_poll_ms']:.1f} ms per poll net; per waiting batch "
          f"{result['core_pct_per_waiting_batch_window']:.3f} % of a core over the window, "
          f"{result['core_pct_per_waiting_batch_steady']:.3f} % at one poll a minute", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
