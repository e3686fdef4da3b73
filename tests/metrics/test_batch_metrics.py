"""Batch-level gauges: pushed by the real operators into one Pushgateway group per batch, lint
clean, and pruned once a batch has been over for the retention time."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client import generate_latest

from aibrix_operators.batch import metrics as batch_metrics
from aibrix_operators.batch.metrics import BatchSnapshot, prune, publish, registry_for
from tests.metrics.batch_run import allow, run_batch


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_batch_exposition_holds_the_snapshot():
    """(`promtool check metrics` on it: test_all_exporters_lint.py)"""
    snap = BatchSnapshot("batch_x", "in_progress", requests=10, completed=7, failed=1, shards=3,
                         shards_done=2, created_at=1.7e9, deadline=1.7e9 + 86400)
    text = generate_latest(registry_for(snap, now=1.7e9 + 5)).decode()
    assert 'aibrix_batch_phase{phase="in_progress"} 1.0' in text
    assert 'aibrix_batch_phase{phase="completed"} 0.0' in text
    assert "aibrix_batch_deadline_timestamp_seconds 1.7000864e+09" in text
    assert "aibrix_batch_last_update_timestamp_seconds 1.700000005e+09" in text


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="phase 'done'"):
        BatchSnapshot("b", "done")


@pytest.mark.e2e
def test_operators_push_the_batch_through_its_phases(tmp_path, fault_server, make_request, pushgateway,
                                                     monkeypatch):
    """validate → split → 3 dispatch tasks → merge of a 9-request batch (one request fails on its
    own): the group ends with the final counts, every shard done, status completed — and a value an
    earlier task pushed (the request count, the window) survives the later pushes."""
    monkeypatch.setenv("AIBRIX_PUSHGATEWAY_URL", pushgateway)
    allow(monkeypatch, tmp_path, fault_server.url)
    records = [make_request(f"r{i}", "ok") for i in range(8)] + [make_request("bad", "400")]
    pushes: list[BatchSnapshot] = []
    real_publish = batch_metrics.publish

    def spy(snap: BatchSnapshot, url: str | None = None, prune_now: bool = False) -> bool:
        pushes.append(snap)
        return real_publish(snap, url, prune_now)

    monkeypatch.setattr("aibrix_operators.operators.batch_metrics.publish", spy)
    result = run_batch(tmp_path, fault_server.url, records, per_shard=3)
    assert result["status"] == "completed"
    batch_id = result["id"]
    assert [p.phase for p in pushes] == ["validating", "in_progress", None, None, None, "finalizing",
                                         "completed"]
    assert [p.shards_done for p in pushes[1:5]] == [0, 1, 2, 3]  # the dispatch tasks' counts
    text = _scrape(pushgateway)
    key = {"job": "aibrix_batch", "batch_id": batch_id}
    assert _sample(text, "aibrix_batch_requests", **key) == 9
    assert _sample(text, "aibrix_batch_requests_completed", **key) == 8
    assert _sample(text, "aibrix_batch_requests_failed", **key) == 1
    assert _sample(text, "aibrix_batch_shards", **key) == 3
    assert _sample(text, "aibrix_batch_shards_done", **key) == 3
    assert _sample(text, "aibrix_batch_phase", **key, phase="completed") == 1
    assert _sample(text, "aibrix_batch_phase", **key, phase="in_progress") == 0
    deadline = _sample(text, "aibrix_batch_deadline_timestamp_seconds", **key)
    created = _sample(text, "aibrix_batch_created_timestamp_seconds", **key)
    assert deadline - created == 24 * 3600  # the default completion window


def test_no_pushgateway_configured_pushes_nothing(monkeypatch):
    monkeypatch.delenv("AIBRIX_PUSHGATEWAY_URL", raising=False)
    assert publish(BatchSnapshot("b", "validating")) is False
    monkeypatch.setenv("AIBRIX_PUSHGATEWAY_URL", "http://127.0.0.1:9")  # nothing listens: logged only
    assert publish(BatchSnapshot("b", "validating"), prune_now=True) is False


@pytest.mark.e2e
def test_finished_and_abandoned_batches_are_pruned_after_the_retention(pushgateway):
    now = time.time()
    publish(BatchSnapshot("done_old", "completed", requests=1), pushgateway)
    publish(BatchSnapshot("running", "in_progress", deadline=now + 86400), pushgateway)
    publish(BatchSnapshot("abandoned", "in_progress", deadline=now - 10), pushgateway)
    publish(BatchSnapshot("failed_old", "failed"), pushgateway)
    # an hour later: the finished ones and the one whose window closed are over an hour old
    assert prune(pushgateway, now=now + 30, keep_s=3600) == []
    deleted = prune(pushgateway, now=now + 3700, keep_s=3600)
    assert sorted(deleted) == ["abandoned", "done_old", "failed_old"]
    text = _scrape(pushgateway)
    assert _sample(text, "aibrix_batch_phase", batch_id="running", phase="in_progress") == 1
    assert _sample(text, "aibrix_batch_phase", batch_id="done_old") is None
