"""Admission with an estimate (batch/admission.py): rates learned, work queued by deadline, the
estimate and what it rests on, and validate admitting, warning or refusing (on real local storage)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from aibrix_operators.batch.admission import (
    Admission,
    Rate,
    Work,
    endpoint_key,
    enqueue,
    estimate,
    learn_rate,
    measured,
    output_limit,
    queued_work,
    read_rate,
    window_for,
)
from aibrix_operators.batch.job import validate_batch
from aibrix_operators.batch.lifecycle import RunSnapshot, TaskState
from aibrix_operators.batch_api.status import batch_object
from aibrix_operators.client.cli import describe_estimate
from aibrix_operators.settings.admission import AdmissionSettingError, parse_admission_mode
from aibrix_operators.storage import LocalStorage

KEY = endpoint_key("m", "http://127.0.0.1:8000")
RATE = Rate(KEY, tokens_per_s=100.0, input_tokens_per_byte=0.25, output_tokens_per_request=10.0)


def test_a_lines_output_bound_is_its_max_tokens_by_any_of_its_names() -> None:
    assert output_limit({"max_tokens": 16}) == 16
    assert output_limit({"max_completion_tokens": 32}) == 32 and output_limit({"max_output_tokens": 8}) == 8
    assert output_limit({"max_tokens": True}) is None and output_limit({"max_tokens": -1}) is None
    assert output_limit({}) is None and output_limit("body") is None


def test_the_estimate_says_what_it_rests_on_and_nothing_without_a_measurement() -> None:
    work = Work(requests=10, input_bytes=4000, max_output_tokens=800, unbounded_requests=2)
    none = estimate(work, None, [], now=1000, submitted_at=1000, deadline=1100)
    assert none.completion_at is None and none.feasible is None and "no measurement yet" in none.basis
    # 4000 bytes x 0.25 + 800 bounded + 2 x 10 measured = 1820 tokens, behind 180: 2000 at 100/s.
    est = estimate(work, RATE, [(1005, 180), (5000, 99)], now=1000, submitted_at=990, deadline=1030)
    assert (est.tokens, est.ahead_tokens, est.seconds, est.completion_at, est.feasible) == (
        1820, 180, 20.0, 1020, True)
    late = estimate(work, RATE, [(1005, 180)], now=1000, submitted_at=990, deadline=1010)
    assert late.feasible is False and late.earliest_window == "1m"  # done at 1020: 30 s after submission
    assert "would be done 20 s from now, after its window ends" in late.why_late()
    # In time itself (done at 1019), but ahead of an admitted batch due at 1025 with 800 tokens it
    # would push that one to 1000 + 2620 / 100 = 1026.2: refused, with a window that ends after both.
    squeezed = estimate(work, RATE, [(1025, 800)], now=1000, submitted_at=990, deadline=1020)
    assert squeezed.feasible is False and squeezed.would_delay_deadline == 1025
    assert squeezed.earliest_window == "1m" and "would make that batch miss it" in squeezed.why_late()
    fits = estimate(work, RATE, [(1025, 600)], now=1000, submitted_at=990, deadline=1020)  # 1024.2
    assert fits.feasible is True and fits.would_delay_deadline is None
    assert window_for(3600) == "1h" and window_for(3601) == "61m" and window_for(0.5) == "1m"


def test_rates_are_learned_per_model_and_endpoint(tmp_path: Path) -> None:
    storage, root = LocalStorage(), str(tmp_path / "state")
    assert read_rate(storage, root, KEY) is None
    assert measured(KEY, 0, 0, 10.0, 100, 0, 1) is None  # nothing answered: nothing learned
    assert measured(KEY, 10, 10, None, 100, 1, 1) is None  # no time: nothing learned
    first = learn_rate(storage, root, measured(KEY, 3000, 1000, 20.0, 12000, 100, 1))
    learned = (first.tokens_per_s, first.input_tokens_per_byte, first.output_tokens_per_request)
    assert learned == (200.0, 0.25, 10.0)
    second = learn_rate(storage, root, measured(KEY, 3000, 1000, 40.0, 12000, 100, 2))
    assert second.tokens_per_s == 150.0 and second.batches == 2  # the newest weighs half
    assert read_rate(storage, root, KEY) == second
    assert read_rate(storage, root, endpoint_key("m", "conn:other")) is None


def test_the_work_ahead_is_the_earlier_deadlines_still_running(tmp_path: Path) -> None:
    storage, root = LocalStorage(), str(tmp_path / "state")
    now = time.time()
    def work(tokens: int) -> Work:  # 4 bytes a token at RATE, no output
        return Work(requests=1, input_bytes=tokens * 4, max_output_tokens=0, unbounded_requests=0)

    enqueue(storage, root, KEY, "batch_early", int(now) + 100, work(500))
    enqueue(storage, root, KEY, "batch_same", int(now) + 200, work(300))
    enqueue(storage, root, KEY, "batch_late", int(now) + 900, work(7000))
    enqueue(storage, root, KEY, "batch_gone", int(now) - 5, work(9000))  # its deadline passed: it ended
    enqueue(storage, root, endpoint_key("other", "http://127.0.0.1:8000"), "batch_x", int(now) + 1, work(100))
    queue = queued_work(storage, root, KEY, now, "batch_mine", RATE)
    assert queue == [(int(now) + 100, 500), (int(now) + 200, 300), (int(now) + 900, 7000)]
    assert (int(now) + 200, 300) not in queued_work(storage, root, KEY, now, "batch_same", RATE)  # not itself
    # Tokens at the rate known when a batch is judged: a batch queued before any measurement counts.
    faster = Rate(KEY, 100.0, input_tokens_per_byte=0.5, output_tokens_per_request=10.0)
    assert queued_work(storage, root, KEY, now, "batch_mine", faster)[0] == (int(now) + 100, 1000)


def _input(tmp_path: Path, n: int, max_tokens: int | None = 16) -> str:
    body: dict = {"model": "m", "messages": [{"role": "user", "content": "x" * 50}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    path = tmp_path / f"in-{n}-{max_tokens}.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": body}) + "\n" for i in range(n)))
    return str(path)


def test_validate_admits_warns_or_refuses_at_the_measured_rate(tmp_path: Path) -> None:
    storage, root = LocalStorage(), str(tmp_path / "state")
    refuse = Admission(storage, root, "http://127.0.0.1:8000", "refuse")
    # No measurement yet: admitted, and the estimate says why it says nothing.
    _, first = validate_batch(storage, _input(tmp_path, 100), str(tmp_path / "o1"), completion_window="1m",
                              min_window_s=1, admission=refuse)
    assert first is not None and "no measurement yet" in first.estimate["basis"]
    learn_rate(storage, root, RATE)
    # 100 lines of ~208 bytes at 0.25 token a byte, plus 16 output tokens each: ~6,800 tokens, 68 s.
    report, refused = validate_batch(storage, _input(tmp_path, 100), str(tmp_path / "o2"),
                                     completion_window="30s", min_window_s=1, admission=refuse)
    assert refused is None
    [error] = report.as_openai_errors()["data"]
    assert error["code"] == "window_infeasible" and error["param"] == "completion_window"
    assert "ask for completion_window 2m or more" in error["message"], error["message"]
    warn = Admission(storage, root, "http://127.0.0.1:8000", "warn")
    _, at_risk = validate_batch(storage, _input(tmp_path, 100), str(tmp_path / "o3"), completion_window="30s",
                                min_window_s=1, admission=warn)
    assert at_risk is not None and at_risk.estimate["feasible"] is False
    assert at_risk.estimate["earliest_window"] == "2m" and at_risk.admission_key == KEY
    # Admitted work is queued (the first batch's too, admitted before there was a rate): the next
    # batch with a later deadline waits behind both.
    _, behind = validate_batch(storage, _input(tmp_path, 100), str(tmp_path / "o4"), completion_window="1h",
                               min_window_s=1, admission=warn)
    assert behind is not None and behind.estimate["feasible"] is True
    assert behind.estimate["ahead_tokens"] == 2 * at_risk.estimate["tokens"]
    # A line without max_tokens is bounded by the measured mean (10), not by 16.
    _, unbounded = validate_batch(storage, _input(tmp_path, 100, None), str(tmp_path / "o5"),
                                  completion_window="1h", min_window_s=1, admission=warn)
    assert unbounded is not None
    assert unbounded.estimate["tokens"] == round(unbounded.total_bytes * 0.25 + 100 * 10)
    assert at_risk.estimate["tokens"] == round(at_risk.total_bytes * 0.25 + 100 * 16)


def test_the_api_shows_the_admitted_estimate_then_the_batchs_own_rate() -> None:
    conf = {"completion_window": "1h", "batch_endpoint": "/v1/chat/completions",
            "openai_batch": {"input_file_id": "file-x", "created_at": 100}}
    snap = RunSnapshot("batch_" + "0" * 32, conf, "running", {"validate": [TaskState("success", 1, 200)]})
    snap.estimate = {"completion_at": 900, "basis": "200.0 tokens/s measured over 1 batch(es)",
                     "feasible": True,
                     "earliest_window": None, "tokens": 5000, "ahead_tokens": 0, "tokens_per_s": 200.0}
    shown = batch_object(snap, now=300)["aibrix_estimate"]
    assert shown["completion_at"] == 900 and shown["feasible"] is True
    snap.live_counts = (100, 25, 0)  # a quarter answered in the 100 s since validation ended
    live = batch_object(snap, now=300)["aibrix_estimate"]
    assert live["completion_at"] == 600 and "own rate so far: 25 answers in 100 s" in live["basis"]
    # With its tokens so far, the tokens it has left at the endpoint's measured rate: 75 requests at
    # 100 tokens an answer, 7,500 tokens at 200 tokens/s, 37.5 s from now (not the 200 s its own rate
    # says, which counts the time it waited as time it was slow).
    snap.live_usage = {"input_tokens": 2000, "output_tokens": 500, "total_tokens": 2500}
    live = batch_object(snap, now=300)["aibrix_estimate"]
    assert live["completion_at"] == 338 and live["tokens_left"] == 7500, live
    assert "7500 tokens left (2500 in its 25 answers so far)" in live["basis"]
    text = describe_estimate({"completion_at": 0, "basis": "b", "feasible": False, "earliest_window": "2h"})
    assert text.startswith("done by 1970-01-01 00:00:00 UTC (b); AT RISK") and "would be met is 2h" in text


def test_the_deployment_mode_is_checked_by_name() -> None:
    assert parse_admission_mode(None) == "warn" and parse_admission_mode(" Refuse ") == "refuse"
    with pytest.raises(AdmissionSettingError, match=r"\[aibrix_batch\] admission = 'deny'"):
        parse_admission_mode("deny")


def test_a_state_store_that_fails_admits_the_batch_and_says_why(tmp_path: Path) -> None:
    class Down(LocalStorage):
        def list(self, prefix_uri: str, after: str | None = None) -> list[str]:
            raise OSError("the state store is down")

        def exists(self, uri: str) -> bool:
            raise OSError("the state store is down")

        def read_bytes(self, uri: str) -> bytes:
            raise OSError("the state store is down")

        def write_bytes(self, uri: str, data: bytes) -> None:
            raise OSError("the state store is down")

    refuse = Admission(Down(), str(tmp_path / "state"), "http://127.0.0.1:8000", "refuse")
    report, batch = validate_batch(LocalStorage(), _input(tmp_path, 10), str(tmp_path / "o"),
                                   completion_window="1m", min_window_s=1, admission=refuse)
    assert report.ok and batch is not None  # advice never loses a batch, even in refuse mode
    assert batch.estimate["completion_at"] is None
    assert "could not be read (the state store is down)" in batch.estimate["basis"]
