"""The measurement helpers of bench/batch_api.py (percentiles, the /proc process tree and RSS,
the batch file writer) and its arrival-logging stub. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import fake_openai
from tests.scripts import BENCH, load_script


def _load():
    return load_script("bench_batch_api", BENCH / "batch_api.py")


bench = _load()


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert bench.percentile(values, 50) == 50
    assert bench.percentile(values, 99) == 99
    assert bench.percentile(values, 100) == 100
    assert bench.percentile([5.0, 1.0, 3.0], 99) == 5.0  # few samples: p99 is the worst one
    assert bench.percentile([2.0], 0) == 2.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    summary = bench.latency_summary([0.010, 0.020, 0.030, 0.040], wall_s=0.05)
    assert summary["p50_ms"] == pytest.approx(20) and summary["p99_ms"] == pytest.approx(40)
    assert summary["rps"] == pytest.approx(80) and summary["n"] == 4
    assert bench.mb_per_s(200_000_000, 4.0) == 50.0


def _fake_proc(root: Path, pid: int, ppid: int, comm: str, rss_kb: int) -> None:
    (root / str(pid)).mkdir()
    # The command name may hold spaces and parentheses; the parser must find the last ')'.
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (root / str(pid) / "status").write_text(f"Name:\t{comm}\nVmPeak:\t 999 kB\nVmRSS:\t {rss_kb} kB\n")


def test_process_tree_and_rss_from_proc(tmp_path):
    _fake_proc(tmp_path, 10, 1, "airflow api_server", 1000)
    _fake_proc(tmp_path, 11, 10, "worker (a) b", 200)
    _fake_proc(tmp_path, 12, 11, "grandchild", 30)
    _fake_proc(tmp_path, 13, 1, "unrelated", 5000)
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    assert bench.process_tree(10, tmp_path) == [10, 11, 12]
    assert bench.rss_bytes([10, 11, 12], tmp_path) == 1230 * 1024
    assert bench.rss_bytes([10, 99], tmp_path) == 1000 * 1024  # an exited process counts 0


def test_rss_sampler_samples_this_process():
    with bench.RssSampler([os.getpid()], interval_s=0.001) as sampler:
        time.sleep(0.02)
    assert sampler.samples and sampler.peak > 10 * 1024 * 1024


def test_write_batch_file_by_count_and_by_size(tmp_path):
    by_count = tmp_path / "n.jsonl"
    assert bench.write_batch_file(by_count, requests=1234) == 1234
    lines = by_count.read_text().splitlines()
    assert len(lines) == 1234 and len({json.loads(x)["custom_id"] for x in lines}) == 1234
    assert json.loads(lines[0])["body"]["model"] == bench.MODEL
    by_size = tmp_path / "s.jsonl"
    n = bench.write_batch_file(by_size, target_bytes=300_000)
    size = by_size.stat().st_size
    assert 300_000 - 400 < size <= 300_000 and by_size.read_bytes().count(b"\n") == n


@pytest.mark.service
def test_arrival_stub_answers_late_and_logs_arrivals():
    proc = subprocess.Popen(
        [sys.executable, str(fake_openai.__file__), "--delay", "0.05"], stdout=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
        before = time.time()
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            data=b"{}",
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["object"] == "chat.completion"
        assert time.time() - before >= 0.05
        stats = json.loads(urllib.request.urlopen(url + "/stats", timeout=10).read())
        assert stats["requests"] == 1 and before <= stats["first_at"] == stats["last_at"] <= time.time()
        urllib.request.urlopen(urllib.request.Request(url + "/reset", data=b"", method="POST"), timeout=10)
        assert json.loads(urllib.request.urlopen(url + "/stats", timeout=10).read())["requests"] == 0
    finally:
        proc.kill()
        proc.wait()
