"""Short-lived publishers through a real Pushgateway (Debian's): a driver's final totals and a
night's eval scores arrive, grouped so concurrent pushers do not overwrite each other."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest

from aibrix_operators.driver import metrics as driver_metrics
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.evaluation.history import Night
from aibrix_operators.evaluation.metrics import night_registry, push_night
from aibrix_operators.storage import LocalStorage


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not pushed")


@pytest.mark.service
async def test_driver_pushes_its_totals_when_the_shard_ends(tmp_path, fault_server, make_request,
                                                            pushgateway, monkeypatch):
    monkeypatch.setenv("AIBRIX_PUSHGATEWAY_URL", pushgateway)
    shard = tmp_path / "shard-00000.jsonl"
    shard.write_text("".join(json.dumps(make_request(f"r{i}", "ok")) + "\n" for i in range(15)))
    config = DriverConfig(endpoint=fault_server.url + "/v1", concurrency=4, api_key_env=None,
                          flush_interval_s=0.05, progress_interval_s=1.0)
    outcome = await run_shard(LocalStorage(), str(shard), str(tmp_path / "res"), config)
    assert outcome.completed == 15
    totals = driver_metrics.COLLECTOR.totals()  # this process's, all shards so far
    text = _scrape(pushgateway)
    instance = f"{socket.gethostname()}:{os.getpid()}"
    assert _sample(text, "aibrix_driver_requests_total", job="aibrix_driver", instance=instance,
                   outcome="completed") == totals["completed"] >= 15
    assert _sample(text, "aibrix_driver_request_duration_seconds_count", job="aibrix_driver") >= 15


@pytest.mark.service
def test_eval_night_pushed_per_suite_and_model(pushgateway, monkeypatch):
    monkeypatch.setenv("AIBRIX_PUSHGATEWAY_URL", pushgateway)
    good = Night("2026-11-01", "m", 0.97, 0.94, 0.99, 100)
    bad = Night("2026-11-02", "m", 0.40, 0.30, 0.50, 100, regression=True)
    assert push_night(night_registry("arithmetic", "m", bad, [good, bad], 1.7e9), "arithmetic", "m")
    assert push_night(night_registry("multiple_choice", "m", good, [good], 1.7e9), "multiple_choice", "m")
    text = _scrape(pushgateway)
    assert _sample(text, "aibrix_eval_score", suite="arithmetic", model="m") == 0.40
    assert _sample(text, "aibrix_eval_score", suite="multiple_choice", model="m") == 0.97  # not overwritten
    assert _sample(text, "aibrix_eval_regression", suite="arithmetic") == 1
    assert _sample(text, "aibrix_eval_regressions_total", suite="arithmetic") == 1


def test_push_failure_never_raises(monkeypatch):
    monkeypatch.setenv("AIBRIX_PUSHGATEWAY_URL", "http://127.0.0.1:9")  # nothing listens
    assert driver_metrics.push_from_env() is False
    reg = night_registry("s", "m", Night("2026-11-01", "m", 1.0, 1.0, 1.0, 1), [], 0.0)
    assert push_night(reg, "s", "m") is False


def test_a_taken_metrics_port_does_not_fail_the_driver(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setenv("AIBRIX_DRIVER_METRICS_PORT", str(held.getsockname()[1]))
        monkeypatch.setattr(driver_metrics, "_server_started", False)
        monkeypatch.setattr(driver_metrics, "_bound_port", None)
        assert driver_metrics.serve_from_env() is None
