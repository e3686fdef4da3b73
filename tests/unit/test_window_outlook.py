""""Will it finish in its window?": one judgement for the driver's AT RISK lines and metric
and for the Batch API's status line (issue 21: a batch that cannot make its window is said
early, in its log, a metric and the batch object's ``aibrix_status`` field)."""

from __future__ import annotations

import logging
import time

import pytest

from aibrix_operators.batch.window_outlook import MIN_ELAPSED_S, window_outlook
from aibrix_operators.batch_api.status import STATUS_LINE_KEY, RunSnapshot, TaskState, batch_object
from aibrix_operators.driver.progress import ProgressReporter


def test_the_outlook_compares_the_time_needed_at_the_measured_rate_with_the_time_left() -> None:
    on_track = window_outlook(remaining=100, answered=50, elapsed_s=25, left_s=60)  # 2/s: 50 s of 60
    assert on_track is not None and not on_track.at_risk and on_track.needed_s == pytest.approx(50)
    assert on_track.line() == "on track: 100 requests left, ~50s at 2.0 req/s; the window closes in 60s"
    late = window_outlook(remaining=100, answered=50, elapsed_s=25, left_s=49)
    assert late is not None and late.at_risk
    assert late.line() == "at risk: 100 requests left need ~50s at 2.0 req/s, but the window closes in 49s"
    # Nothing to judge yet: too early, nothing answered, or nothing left.
    assert window_outlook(100, 50, MIN_ELAPSED_S - 0.1, 1) is None
    assert window_outlook(100, 0, 60, 1) is None
    assert window_outlook(0, 50, 60, 1) is None


def test_a_shard_that_cannot_make_its_window_warns_once_and_says_so_in_each_line(caplog) -> None:
    p = ProgressReporter("shard-00001", total=1000, interval_s=1, deadline=time.time() + 30)
    p.started -= 20  # 20 s in: 100 answered at 5/s, 900 left need 180 s of 30
    with caplog.at_level(logging.WARNING, logger="aibrix_operators.driver.progress"):
        first, second = p.line(90, 10), p.line(95, 10)
    assert p.at_risk and "AT RISK" in first and "AT RISK" in second
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("shard-00001: at risk: 900 requests left need ~180s at 5.0 req/s")
    assert "longer completion_window" in warning
    relaxed = ProgressReporter("shard-00002", total=1000, interval_s=1, deadline=time.time() + 3600)
    relaxed.started -= 20
    assert "AT RISK" not in relaxed.line(90, 10) and not relaxed.at_risk


def _in_progress(created_at: float, window: str, total: int, answered: int, metadata=None) -> RunSnapshot:
    conf = {"completion_window": window, "batch_endpoint": "/v1/chat/completions",
            "openai_batch": {"input_file_id": "file-x", "created_at": int(created_at)}, "metadata": metadata}
    snap = RunSnapshot("batch_" + "0" * 32, conf, "running",
                       {"validate": [TaskState("success", created_at, created_at + 10)],
                        "dispatch": [TaskState("running", created_at + 10, None)]})
    snap.live_counts = (total, answered, 0)
    return snap


def test_the_batch_api_shows_the_outlook_beside_the_clients_metadata_while_the_batch_runs() -> None:
    now = 1_800_000_000.0
    # 110 s in progress, 220 answered (2/s), 780 left need 390 s; window 1h from 120 s ago.
    relaxed = batch_object(_in_progress(now - 120, "1h", 1000, 220, {"project": "eval"}), now=now)
    assert relaxed["status"] == "in_progress"
    line = "on track: 780 requests left, ~390s at 2.0 req/s; the window closes in 3480s"
    assert relaxed[STATUS_LINE_KEY] == line
    assert relaxed["metadata"] == {"project": "eval"}  # the client's, exactly as sent
    # The same progress in a 5-minute window: 180 s left.
    tight = batch_object(_in_progress(now - 120, "5m", 1000, 220), now=now)
    assert tight[STATUS_LINE_KEY].startswith("at risk: 780 requests left need ~390s")
    assert tight["metadata"] is None
    # Not in progress (or too early to tell): no status line.
    early = batch_object(_in_progress(now - 12, "1h", 1000, 1, {"project": "eval"}), now=now)
    assert early["metadata"] == {"project": "eval"} and early[STATUS_LINE_KEY] is None
    done = _in_progress(now - 120, "1h", 1000, 1000, {"project": "eval"})
    done.run_state = "success"
    counts = {"total": 1000, "completed": 1000, "failed": 0}
    done.batch_json = {"status": "completed", "request_counts": counts}
    assert batch_object(done, now=now)["metadata"] == {"project": "eval"}
    assert batch_object(done, now=now)[STATUS_LINE_KEY] is None
    # A client's own key of that name stays in its metadata, untouched.
    own = batch_object(_in_progress(now - 120, "1h", 1000, 220, {STATUS_LINE_KEY: "mine"}), now=now)
    assert own["metadata"] == {STATUS_LINE_KEY: "mine"} and own[STATUS_LINE_KEY] == line
