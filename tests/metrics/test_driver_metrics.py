"""Driver metrics: the numbers are the shard's, the exposition passes `promtool check metrics`,
and a real Prometheus scrapes a running batch and answers queries about it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from aibrix_operators.driver import metrics
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.serving.local_vllm import free_port
from aibrix_operators.storage import LocalStorage
from tests.metrics.batch_run import allow, run_batch
from tests.metrics.conftest import PROM_BIN, REPO, check_metrics


def _config(server, **overrides) -> DriverConfig:
    values = dict(endpoint=server.url + "/v1", concurrency=4, max_attempts=3, request_timeout_s=2.0,
                  connect_timeout_s=2.0, backoff_base_s=0.01, backoff_max_s=0.2, flush_interval_s=0.05,
                  progress_interval_s=0.5, api_key_env=None)
    values.update(overrides)
    return DriverConfig(**values)


def _shard(tmp_path: Path, records: list[dict]) -> str:
    path = tmp_path / "shard-00000.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    return str(path)


def _value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in exposition")


@pytest.mark.e2e
async def test_collector_counts_what_the_shard_did(tmp_path, fault_server, make_request, promtool):
    before = generate_latest(metrics.REGISTRY).decode()
    ok0 = _value(before, 'aibrix_driver_requests_total{outcome="completed"}')
    bad0 = _value(before, 'aibrix_driver_requests_total{outcome="failed"}')
    retries0 = _value(before, "aibrix_driver_retries_total")
    count0 = _value(before, "aibrix_driver_request_duration_seconds_count")
    records = [make_request(f"ok-{i}", "ok") for i in range(20)]
    records += [make_request("bad", "400"), make_request("flaky", "503", "ok")]
    outcome = await run_shard(LocalStorage(), _shard(tmp_path, records), str(tmp_path / "res"),
                              _config(fault_server))
    text = generate_latest(metrics.REGISTRY).decode()
    assert _value(text, 'aibrix_driver_requests_total{outcome="completed"}') - ok0 == outcome.completed == 21
    assert _value(text, 'aibrix_driver_requests_total{outcome="failed"}') - bad0 == outcome.failed == 1
    assert _value(text, "aibrix_driver_retries_total") - retries0 == outcome.retries >= 1
    assert _value(text, "aibrix_driver_request_duration_seconds_count") - count0 == 22
    assert _value(text, "aibrix_driver_requests_in_flight") == 0
    assert _value(text, 'aibrix_driver_tokens_total{kind="output"}') >= outcome.usage["output_tokens"] > 0
    lint = check_metrics(promtool, text)
    assert lint.returncode == 0 and lint.stdout.strip() == "", lint.stdout + lint.stderr


def test_latency_buckets_match_prometheus_client_semantics():
    b = metrics.LatencyBuckets((0.1, 1.0))
    for s in (0.05, 0.1, 0.5, 2.0):
        b.observe(s)
    assert b.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]  # le is inclusive, like Histogram
    assert b.count == 4 and b.total == pytest.approx(2.65)


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.e2e
def test_real_prometheus_scrapes_a_running_batch(tmp_path, fault_server, make_request, monkeypatch,
                                                  pushgateway):
    """The project's scrape config (monitoring/prometheus/prometheus.yml), its driver target
    pointed at this process's /metrics and its Pushgateway target at a real Pushgateway, a 1 s
    scrape interval; a batch of slow requests runs through the DAG's operators (validate, split,
    dispatch × 3, merge) while Prometheus scrapes; its HTTP API then holds the drivers' series and
    the batch's own gauges."""
    monkeypatch.setenv("AIBRIX_PUSHGATEWAY_URL", pushgateway)
    allow(monkeypatch, tmp_path, fault_server.url)
    metrics_port, prom_port = free_port(), free_port()
    monkeypatch.setenv("AIBRIX_DRIVER_METRICS_PORT", str(metrics_port))
    bound = metrics.serve_from_env()  # once per process: an earlier server's port if one runs
    assert bound is not None
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "drivers.json").write_text(json.dumps([{"targets": [f"127.0.0.1:{bound}"],
                                                       "labels": {"deployment": "test"}}]))
    config = (REPO / "monitoring" / "prometheus" / "prometheus.yml").read_text()
    config = config.replace("scrape_interval: 15s", "scrape_interval: 1s").replace(
        "/etc/prometheus/targets", str(targets)).replace("pushgateway:9091", pushgateway.split("//")[1])
    (tmp_path / "prometheus.yml").write_text(config)
    check = subprocess.run([str(PROM_BIN / "promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    prom = subprocess.Popen(
        [str(PROM_BIN / "prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
                time.sleep(0.2)
        # Prometheus applies discovered targets every 5 s: wait for the first scrape of ours.
        while not _query(prom_port, 'up{job="aibrix-driver"} == 1'):
            assert time.monotonic() < deadline + 15, "the driver target was never scraped"
            time.sleep(0.3)
        before = _query(prom_port, 'sum(aibrix_driver_requests_total{outcome="completed"})')
        records = [make_request(f"slow-{i}", "slow:0.1") for i in range(120)]  # ~3 s at concurrency 4
        batch = run_batch(tmp_path, fault_server.url, records, per_shard=40)
        assert batch["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
        start = float(before[0]["value"][1]) if before else 0.0
        deadline = time.monotonic() + 20
        while True:  # the scrape after the shard ended holds its final totals
            got = _query(prom_port, 'sum(aibrix_driver_requests_total{outcome="completed"})')
            if got and float(got[0]["value"][1]) - start >= 120:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.5)
        up = _query(prom_port, 'up{job="aibrix-driver"}')
        assert up and up[0]["value"][1] == "1" and up[0]["metric"]["deployment"] == "test"
        hist = _query(prom_port, "sum(aibrix_driver_request_duration_seconds_count)")
        assert float(hist[0]["value"][1]) >= 120
        # the in-flight gauge was seen above zero while the batch ran
        peak = _query(prom_port, "max_over_time(aibrix_driver_requests_in_flight[1m])")
        assert float(peak[0]["value"][1]) >= 1
        # the batch's gauges, pushed by its tasks, scraped from the Pushgateway (honor_labels)
        ours = f'job="aibrix_batch",batch_id="{batch["id"]}"'
        deadline = time.monotonic() + 20
        while not _query(prom_port, f'aibrix_batch_phase{{{ours},phase="completed"}} == 1'):
            assert time.monotonic() < deadline, "the batch's final status never reached Prometheus"
            time.sleep(0.5)
        for name, want in (("aibrix_batch_requests", 120), ("aibrix_batch_requests_completed", 120),
                           ("aibrix_batch_requests_failed", 0), ("aibrix_batch_shards", 3),
                           ("aibrix_batch_shards_done", 3)):
            got = _query(prom_port, f"{name}{{{ours}}}")
            assert len(got) == 1 and float(got[0]["value"][1]) == want, (name, got)
        left = _query(prom_port, f"aibrix_batch_deadline_timestamp_seconds{{{ours}}} - time()")
        assert 23 * 3600 < float(left[0]["value"][1]) <= 24 * 3600  # the 24 h window, just started
        # it was seen in progress while the shards ran (the phase series before merge's push)
        seen = _query(prom_port, f'max_over_time(aibrix_batch_phase{{{ours},phase="in_progress"}}[1m])')
        assert float(seen[0]["value"][1]) == 1
    finally:
        prom.terminate()
        prom.wait(timeout=20)
