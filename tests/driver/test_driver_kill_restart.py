"""A driver process SIGKILLed mid-shard and restarted still answers each id exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from aibrix_operators.batch.job import finalize_batch
from aibrix_operators.batch.shard_results import results_prefix, shard_result_log
from aibrix_operators.storage import LocalStorage
from tests.driver.test_driver_faults import one_shard_batch

pytestmark = pytest.mark.service

N = 150


def driver_cmd(shard, prefix, server) -> list[str]:
    return [
        sys.executable, "-m", "aibrix_operators.driver.cli",
        "--shard-uri", shard.uri, "--results-prefix", prefix, "--endpoint", server.url,
        "--concurrency", "2", "--max-attempts", "3", "--request-timeout", "10",
        "--total", str(shard.num_requests), "--progress-interval", "0.5",
    ]


def test_killed_driver_resumes_and_merge_is_exactly_once(tmp_path, fault_server, make_request):
    storage = LocalStorage()
    records = [make_request(f"k-{i:04d}", "slow:0.03") for i in range(N)]
    batch, work, shard = one_shard_batch(storage, tmp_path, records, "killed-run")
    prefix = results_prefix(work, shard.name)
    log = shard_result_log(storage, prefix, shard.uri)

    # Run 1: killed as soon as the first checkpoint segment is durable.
    first = subprocess.Popen(driver_cmd(shard, prefix, fault_server), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not log.segments():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "driver flushed no segment in 20 s"
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    seen_in_run1 = set(fault_server.counts())
    flushed = log.done_ids()
    assert 0 < len(flushed) < N, "the kill must land mid-shard, after a flush"
    assert flushed <= seen_in_run1
    lost = seen_in_run1 - flushed  # answered or in flight, but not yet durable

    # Run 2: resumes from the checkpoint.
    second = subprocess.run(driver_cmd(shard, prefix, fault_server), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    outcome = json.loads(second.stdout.strip().splitlines()[-1])
    assert outcome["resumed"] == len(flushed)
    assert outcome["completed"] == N - len(flushed) and outcome["failed"] == 0
    assert f"resuming, {len(flushed)} of {N} requests already answered" in second.stderr

    counts = fault_server.counts()
    assert set(counts) == {r["custom_id"] for r in records}
    # Already-durable ids were not sent again; only the unflushed window was.
    assert all(counts[cid] == 1 for cid in flushed)
    assert {cid for cid, n in counts.items() if n == 2} == lost
    assert max(counts.values()) <= 2
    assert sum(counts.values()) == N + len(lost)

    # Merge: every id exactly once, in input order, all completed.
    summary, obj = finalize_batch(storage, batch, [shard], work)
    assert obj.request_counts == {"total": N, "completed": N, "failed": 0}
    out_lines = (tmp_path / "out" / "output.jsonl").read_bytes().splitlines()
    out_ids = [json.loads(x)["custom_id"] for x in out_lines]
    assert out_ids == [r["custom_id"] for r in records]
    assert (tmp_path / "out" / "errors.jsonl").read_bytes() == b""
