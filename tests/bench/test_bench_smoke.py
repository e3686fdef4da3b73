"""Smoke tests: each bench script's main path at tiny sizes, so the scripts don't rot.

They check that the scripts run end to end and print their tables, not the
figures (this machine is shared; the full-size runs are for a person).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.scripts import BENCH, load_script


def _load(name: str) -> ModuleType:
    return load_script(f"bench_{name}", BENCH / f"{name}.py")


def test_generated_batch_is_valid_and_reused(tmp_path: Path) -> None:
    vs = _load("validate_split")
    path = vs.generate(tmp_path / "b.jsonl", 300, line_bytes=400)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 300
    ids = [json.loads(line)["custom_id"] for line in lines]
    assert len(set(ids)) == 300
    assert 200 < sum(map(len, lines)) / 300 < 600
    mtime = path.stat().st_mtime_ns
    assert vs.generate(tmp_path / "b.jsonl", 300, line_bytes=400).stat().st_mtime_ns == mtime

    result = vs.run_validate_split(str(path), str(tmp_path / "out"), 100)
    assert result["requests"] == 300 and result["shards"] == 3
    assert result["bytes"] == path.stat().st_size and result["peak_rss_kib"] > 0


@pytest.mark.service
def test_validate_split_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vs = _load("validate_split")
    rc = vs.main(
        ["--lines", "400", "--rss-lines", "100", "--shard-requests", "150", "--workdir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc in (0, 1)  # the verdict depends on the machine, not on the code path
    for needle in (
        "baseline: wc -l",
        "baseline: python line loop",
        "validate + split",
        "peak RSS",
        "3 shards of 150 requests",
    ):
        assert needle in out
    assert not (tmp_path / "split-out").exists()


@pytest.mark.service
def test_driver_stub_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = _load("driver_stub")
    rc = ds.main(["--requests", "300", "--concurrency", "4,16", "--no-pin", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    for needle in (
        "baseline: raw client (ceiling)",
        "run_shard, concurrency 4",
        "run_shard, concurrency 16",
        "target >= 2000",
    ):
        assert needle in out


@pytest.mark.service
def test_stub_answers_keep_alive_and_pipelined_requests() -> None:
    ds = _load("driver_stub")
    import socket

    from tests import fake_openai as stub_mod

    with ds.StubProcess(cpu=None) as stub:
        body = b'{"model":"m","messages":[]}'
        req = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        with socket.create_connection(("127.0.0.1", stub.port), timeout=5) as sock:
            sock.sendall(req * 3)  # pipelined, one connection
            want = len(stub_mod.CHAT) * 3
            got = b""
            while len(got) < want:
                chunk = sock.recv(65536)
                assert chunk
                got += chunk
        assert got == stub_mod.CHAT * 3
        answer = json.loads(stub_mod.CHAT_BODY)
        assert answer["object"] == "chat.completion" and answer["usage"]["total_tokens"] == 130
        assert stub_mod.ceiling(stub.port, requests=200, connections=4) > 0


@pytest.mark.service
def test_stub_serves_a_vllm_metrics_page_that_shared_mode_reads(tmp_path: Path) -> None:
    """--shared-cost's parts without callgrind: the page is understood by the controller (a
    tick that reads nothing would measure the no-signal fallback), and a shared-mode run ends."""
    ds = _load("driver_stub")
    with ds.StubProcess(cpu=None, metrics_page=ds.VLLM_METRICS_PAGE) as stub:
        assert ds.tick_cost_us(stub.port, ticks=5) > 0  # asserts the scrape was understood
        shard = ds.write_shard(tmp_path / "shard.jsonl", 200)
        r = ds.run_driver(shard, tmp_path / "results", stub.port, 8, 200, shared_tick_s=0.5)
    assert r["retries"] == 0


def test_kvcache_prefix_pairs_samples_and_pools_runs() -> None:
    kp = _load("kvcache_prefix")
    # Pipelined is 10% faster than sync in every pair, while the machine drifts 2x
    # between rounds: the paired ratio sees the 10%, not the drift.
    drift = [0.2, 0.4, 0.2, 0.4, 0.3]
    pipelined = [d * 1.0 for d in drift]
    sync = [d * 1.1 for d in drift]
    med, lo, hi = kp.paired_ratio(sync, pipelined)
    assert abs(med - 1.1) < 1e-9 and lo <= med <= hi and abs(hi - lo) < 1e-9

    def one_run(scale: float) -> dict:
        return {
            "first": {"cold": [3.0, 3.0], "ours_l1": [3.1, 3.1], "ours_sync_l1": [3.3, 3.3]},
            "hits": {"ours_l1": [0.2 * scale] * 3, "ours_sync_l1": [0.22 * scale] * 3},
            "cached": {"ours_l1": 1536, "ours_sync_l1": 1408},
            "connector": {"ours_l1": {"kvcache_load_seconds": 0.01 * scale, "kvcache_save_seconds": 0.0}},
        }

    merged = kp.merge_runs([one_run(1.0), one_run(2.0)])
    assert merged["hits"]["ours_l1"] == [0.2] * 3 + [0.4] * 3
    assert merged["cached"]["ours_sync_l1"] == 1408
    assert abs(merged["connector"]["ours_l1"]["kvcache_load_seconds"] - 0.015) < 1e-12
    args = SimpleNamespace(prompts=3, tokens=1600, runs=2, rounds=3, model="m", bind="0")
    summary = kp.report(merged, args)
    hit = summary["ratios"]["hit sync / pipelined"]
    assert abs(hit["median"] - 1.1) < 1e-9 and [round(r, 6) for r in hit["per_run"]] == [1.1, 1.1]
    assert abs(summary["ratios"]["miss ours_l1 / cold"]["median"] - 3.1 / 3.0) < 1e-9
    assert summary["conditions"]["ours_l1"]["connector_load_ms"] == pytest.approx(15.0)


def test_kvcache_prefix_pooled_ratio_averages_over_each_conditions_servers() -> None:
    """Two servers per mode, one pipelined server 20% slow (a server effect, not the mode's):
    the pooled line compares each mode's mean over its servers, the plain line one pair."""
    kp = _load("kvcache_prefix")
    hits = {
        "ours_l1": [1.0] * 4,
        "ours_l1#2": [1.2] * 4,
        "ours_sync_l1": [1.1] * 4,
        "ours_sync_l1#2": [1.1] * 4,
    }
    first = {name: [2.0] for name in hits}
    res = {
        "first": first,
        "hits": hits,
        "cached": {},
        "connector": {},
        "per_run": [{"hits": hits, "first": first}],
    }
    args = SimpleNamespace(prompts=2, tokens=16, runs=1, rounds=2, model="m", bind="0")
    ratios = kp.report(res, args)["ratios"]
    assert abs(ratios["hit sync / pipelined"]["median"] - 1.1) < 1e-9
    pooled = ratios["hit sync / pipelined, pooled"]
    assert abs(pooled["median"] - 1.0) < 1e-9
    assert pooled["servers"] == [["ours_sync_l1", "ours_sync_l1#2"], ["ours_l1", "ours_l1#2"]]
    assert "hit ours_l1 / example_conn, pooled" not in ratios  # needs two servers of each


@pytest.mark.service
def test_driver_container_start_bench_runs_both_modes() -> None:
    import subprocess

    proc = subprocess.run([sys.executable, str(BENCH / "driver_container_start.py"), "--runs", "1",
                           "--requests", "3"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert {line.split()[0] for line in lines[-3:-1]} == {"container", "process"}, lines
    assert lines[-1].startswith("container / process (medians): ")


@pytest.mark.service
def test_dag_at_scale_profiles_a_shard_and_reads_its_own_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    das = _load("dag_at_scale")
    args = SimpleNamespace(per_shard=500, concurrency=8, workdir=tmp_path)
    assert das.profile_shard(args) == 0
    out = capsys.readouterr().out
    assert "500 completed, 0 failed" in out and "aiohttp (client" in out
    (tmp_path / "o").mkdir()
    lines = ('{"custom_id":"r0"}', '{"custom_id":"r1"}', '{"custom_id":"r1"}')
    (tmp_path / "o" / "output.jsonl").write_text("".join(line + "\n" for line in lines))
    assert das.count_output(tmp_path / "o", 3) == "2 answered, 1 twice, 1 missing"
    log = tmp_path / "dag.log"
    log.write_text(
        "2026-12-04T10:00:00.000000Z [info] [DAG TEST] starting task_id=dispatch map_index=0 [x]\n"
        "2026-12-04T10:00:02.500000Z [info] [DAG TEST] end task task_id=dispatch map_index=0 [x]\n"
        "2026-12-04T10:00:02.500000Z [info] [DAG TEST] starting task_id=dispatch map_index=1 [x]\n"
        "2026-12-04T10:00:03.000000Z [info] [DAG TEST] end task task_id=dispatch map_index=1 [x]\n"
    )
    assert das.task_seconds(log) == {"dispatch": pytest.approx(3.0)}
    # Each step's peak: the largest sample inside any of its spans, none from outside them.
    at = das.datetime.fromisoformat
    samples = [(at("2026-12-04T10:00:01+00:00"), 250.0), (at("2026-12-04T10:00:02.8+00:00"), 280.0),
               (at("2026-12-04T10:00:04+00:00"), 400.0)]
    assert das.step_peaks(das.task_spans(log), samples) == {"dispatch": 280.0}


def test_partial_results_bench_streams_what_it_wrote(tmp_path: Path) -> None:
    """bench/partial_results.py's two phases at a tiny size, in this process: the partial phase
    streams every answer the writer wrote, as many bytes as the raw phase less nothing but the
    reordering (same lines)."""
    pr = _load("partial_results")
    specs = pr.write_batch(tmp_path, shards=2, per_shard=300, line_bytes=200)
    (tmp_path / "shards.json").write_text(json.dumps([s.as_dict() for s in specs]))
    raw = pr.run_phase("raw", tmp_path, 2)
    partial = pr.run_phase("partial", tmp_path, 2)
    assert raw["bytes"] == partial["bytes"] > 600 * 150
    assert partial["shards"] == 2 and partial["mb_s"] > 0



@pytest.mark.service
def test_deferred_wait_counts_each_triggers_polls_and_refuses_a_batch_that_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench/deferred_wait.py's loop of real BatchApiTriggers, against OpenAI's Batch API as the
    fake serves it: three triggers on a batch that runs on poll once each in a short window (the
    backoff's first wait is 5 s); on a batch that ends at its second poll, one fires and the
    bench refuses the window (its figures assume every trigger waited throughout)."""
    import asyncio
    import io

    import openai

    from tests.fake_openai import FakeOpenAI

    dw = _load("deferred_wait")
    fake = FakeOpenAI().start()
    try:
        monkeypatch.setenv("AIRFLOW_CONN_AIBRIX_BATCH_DEFAULT", json.dumps(
            {"conn_type": "aibrix_batch", "host": fake.url + "/v1", "password": "sk-any"}))
        client = openai.OpenAI(base_url=fake.url + "/v1", api_key="sk-any", max_retries=0)
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}})

        def batch() -> str:
            file_id = client.files.create(file=("in.jsonl", io.BytesIO(line.encode() + b"\n")),
                                          purpose="batch").id
            return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id

        fake.batches.polls_to_finish = 1000
        assert asyncio.run(dw.wait_deferred(batch(), waiting=3, window_s=1.0)) == 3
        fake.batches.polls_to_finish = 2
        with pytest.raises(AssertionError, match="a trigger fired inside the window"):
            asyncio.run(dw.wait_deferred(batch(), waiting=3, window_s=1.0))
    finally:
        fake.stop()


def test_admission_replay_admits_refuses_and_scores_its_estimates(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load("admission_replay")
    # A small, steady endpoint for 3 h: some windows cannot be met and are refused; what is admitted
    # with a measurement meets its window.
    result = bench.replay(1, hours=3, per_hour=12, capacity=2000, drift_step=0.0)
    assert result["admitted"] + result["refused"] == result["batches"] > 10
    assert result["refused"] > 0 and result["missed_windows"] == []
    assert {"p50", "p90", "share_within_15pct"} <= set(result["eta_error_own"])
    # What the API shows is scored too; with nothing ahead at 10 % (earliest deadline first) it is the
    # queue estimate.
    assert result["eta_error_api"]["p50"] == result["eta_error_queue"]["p50"]
    # A started batch keeping the endpoint: nothing comes ahead of a batch after 10 %, so on a steady
    # endpoint every estimate is within 15 % (under earliest deadline first 3 of 31 are not: later
    # batches with earlier deadlines took the endpoint), and every window is still met.
    kept = bench.replay(1, hours=3, per_hour=12, capacity=2000, drift_step=0.0, non_preemptive=True)
    assert kept["non_preemptive"] and kept["missed_windows"] == []
    assert result["eta_error_api"]["share_within_15pct"] < 1.0 == kept["eta_error_api"]["share_within_15pct"]
    assert bench.main(["--seeds", "2", "--hours", "1", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())[0]["seed"] == 2
    assert '"seed": 2' in capsys.readouterr().out


@pytest.mark.service  # it starts the two trees' processes
def test_validate_pair_times_both_trees(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load("validate_pair")
    assert bench.main(["--other", str(BENCH.parent / "plugins"), "--lines", "300", "--pairs", "1"]) == 0
    assert "this / other (medians):" in capsys.readouterr().out


def test_eta_real_stack_scores_an_estimate_against_the_end() -> None:
    bench = _load("eta_real_stack")
    lines = bench.batch_file(20, (8, 16), seed=1).decode().splitlines()
    assert len(lines) == 20 and all(8 <= json.loads(x)["body"]["max_tokens"] <= 16 for x in lines)
    # In progress from t=100; 10 answered of 100 at t=110, when the estimate says t=200; ended at 190:
    # off by 10 s of the 80 to go. The own rate (10 s for 10) says 110 + 90 = 200 as well.
    polls = [{"t": 105.0, "status": "in_progress", "answered": 0, "total": 100, "estimate": None},
             {"t": 110.0, "status": "in_progress", "answered": 10, "total": 100,
              "estimate": {"completion_at": 200, "basis": "b"}}]
    scored = bench.score("b1", 100, "1h", polls, {"status": "completed", "end": 190.0, "in_progress_at": 100,
                                                  "created_at": 90})
    assert scored["at_10"]["error"] == 0.125 and scored["at_10"]["own_rate_error"] == 0.125
    assert scored["at_25"] is None and scored["seconds"] == 100.0
