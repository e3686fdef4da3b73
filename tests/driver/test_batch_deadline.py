"""A batch's deadline is one instant for everyone (batch/deadline.py): submission + window.

A batch submitted with a 15-minute window whose validation starts 10 minutes later expires at
submission + 15 minutes in the API's object, in the deadline weights and in the driver, which
stops sending then: the unsent requests end ``batch_expired``. Counting from validation instead
(the old driver's rule) would give it 10 minutes more than the API showed.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from types import SimpleNamespace

from aibrix_operators.batch.job import validate_batch
from aibrix_operators.batch.lifecycle import RunSnapshot
from aibrix_operators.batch_api.batches import API_CONF_KEY
from aibrix_operators.batch_api.status import batch_object
from aibrix_operators.scheduling import deadline_order
from aibrix_operators.storage import LocalStorage
from tests.driver.test_driver_faults import run

WINDOW = "15m"
WAITED_S = 600  # the batch waited this long for a worker before its validate step started


def _validated(tmp_path, records: list[dict], submitted: int):
    inp = tmp_path / "input.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    report, batch = validate_batch(LocalStorage(), str(inp), str(tmp_path / "out"), completion_window=WINDOW,
                                   min_window_s=60, submitted_at=submitted)
    assert report.ok and batch is not None, report.summary()
    return batch


def _weight(conf: dict, run_after: datetime) -> int:
    ti = SimpleNamespace(task_id="dispatch", priority_weight=None)
    deadline_order.task_instance_mutation_hook(ti, SimpleNamespace(conf=conf, run_after=run_after))
    return ti.priority_weight


def test_the_api_the_weights_and_the_validated_batch_share_one_deadline(tmp_path, make_request) -> None:
    submitted = int(time.time()) - WAITED_S  # validation starts now, 10 minutes after submission
    expected = submitted + 15 * 60
    conf = {"completion_window": WINDOW, API_CONF_KEY: {"created_at": submitted, "input_file_id": "file-1"}}

    shown = batch_object(RunSnapshot("batch_1", conf, "running"))
    batch = _validated(tmp_path, [make_request("a"), make_request("b")], submitted)
    # The API triggers the run with run_after at its created_at (airflow_runs.BatchRuns.trigger).
    weight = _weight(conf, datetime.fromtimestamp(submitted, UTC))

    assert shown["created_at"] == batch.created_at == submitted
    assert shown["expires_at"] == batch.expires_at == expected
    assert weight == deadline_order.deadline_weight(expected)
    # Counted from validation, the weight would be ten minutes (ten units) lower.
    assert weight - deadline_order.deadline_weight(expected + WAITED_S) == WAITED_S // 60


async def test_the_driver_stops_at_submission_plus_window_not_validation_plus_window(
    tmp_path, fault_server, make_request,
) -> None:
    # Submitted 14 m 57 s ago with a 15 m window: 3 s left when validation runs now (10 more
    # minutes if the window counted from here). Each request takes 0.5 s, one at a time.
    records = [make_request(f"r{i:02d}", "slow:0.5") for i in range(20)]
    batch = _validated(tmp_path, records, int(time.time()) - (15 * 60 - 3))
    outcome, results = await run(tmp_path / "shard", fault_server, records, concurrency=1,
                                 request_timeout_s=5.0, deadline=float(batch.expires_at))

    assert len(results) == 20  # every id answered once
    expired = [cid for cid, r in results.items() if r["error"] and r["error"]["code"] == "batch_expired"]
    answered = [cid for cid, r in results.items() if r["response"] and r["response"]["status_code"] == 200]
    assert len(answered) + len(expired) == 20 and expired and answered
    assert outcome.failed == len(expired)
    # Nothing was sent after the deadline: each sent request arrived before it (the server keeps
    # monotonic arrival times; this is the wall clock's offset from them).
    wall_minus_monotonic = time.time() - time.monotonic()
    last_arrival = max(t for cid in fault_server.counts() for t in fault_server.times(cid))
    assert last_arrival + wall_minus_monotonic < batch.expires_at + 0.05
