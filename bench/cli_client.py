"""The submitter's tools (``aibrix-batch`` / ``BatchClient``): how fast they stream, how little
they hold, and what following a batch costs the api-server.

  results  ``aibrix-batch results ID -o FILE`` of a ~1 GB output served by the stand-in Batch
           API (tests/client/batch_api_stub.py, its own process, sending one prepared block
           again and again, so the client is what is measured): MB/s over the command's whole
           wall time (process start included) and the CLI's peak RSS (ru_maxrss of a parent
           whose only child it is).
  upload   ``aibrix-batch create --input`` of a 200 MB file (OpenAI's limit) into a real
           deployment (bench/batch_api.py's: api-server, scheduler, SeaweedFS S3 storage root,
           the DAG paused so the batches stay queued): MB/s over the command's wall time.
  poll     api-server CPU per ``GET /v1/batches/{id}`` (what ``status --watch`` sends once a
           second) on a batch *in progress* (5,000 requests in one shard against a stub endpoint
           answering after 1 s, so live request_counts are read from the drivers' checkpoints),
           right after the first answers and again half-way (~2,500 answers, some 40 result
           segments): the api-server process tree's CPU time (/proc utime+stime) over ``--polls``
           back-to-back polls, minus its CPU over an equally long idle window right after; and
           the same for ``GET /api/v2/version``, Airflow's cheapest route, as the floor of any
           request to this api-server on this machine (a poll's cost is reported over it too).

    .venv/bin/python bench/cli_client.py --json /tmp/cli_client.json     # ~5 min
    .venv/bin/python bench/cli_client.py --phases results --results-mb 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

CLI = str(Path(sys.executable).with_name("aibrix-batch"))
MB = 1_000_000
MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
           "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
           "print(p.returncode, time.perf_counter() - t, "
           "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def measured(*args: str, env: dict[str, str] | None = None) -> tuple[int, float, int]:
    """(exit code, wall s, peak RSS bytes) of one CLI run."""
    out = subprocess.run([sys.executable, "-c", MEASURE, CLI, *args], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    return int(out[0]), float(out[1]), int(out[2])


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def phase_results(work: Path, mb: int, rounds: int) -> dict:
    from tests.client.batch_api_stub import BATCH_ID, KEY

    stub = subprocess.Popen([sys.executable, str(REPO / "tests/client/batch_api_stub.py"),
                             "--output-mb", str(mb)], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(stub.stdout.readline())}"  # type: ignore[union-attr]
        conn = ("--base-url", url, "--api-key", KEY)
        code, start_s, base_rss = measured("status", BATCH_ID, *conn)
        assert code == 0
        rows = []
        for r in range(rounds):
            out = work / "results.jsonl"
            code, wall, rss = measured("results", BATCH_ID, "-o", str(out), *conn)
            size = out.stat().st_size
            assert code == 0 and size >= mb * MB * 0.99, (code, size)
            out.unlink()
            rows.append({"mb_s": size / MB / wall, "wall_s": wall, "peak_rss_mb": rss / MB})
            print(f"  results round {r + 1}: {size / MB:.0f} MB in {wall:.2f} s = "
                  f"{rows[-1]['mb_s']:.0f} MB/s, peak RSS {rss / MB:.1f} MB "
                  f"(a status call: {base_rss / MB:.1f} MB, {start_s:.2f} s)", flush=True)
    finally:
        stub.kill()
        stub.wait()
    return {"bytes": size, "mb_s": statistics.median(r["mb_s"] for r in rows),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rows), "status_call_rss_mb": base_rss / MB,
            "status_call_s": start_s, "rounds": rows}


def server_cpu(pids: list[int], calls: int, call) -> dict:
    """The api-server's CPU per call over ``calls`` back-to-back calls, net of its CPU over
    an equally long idle window right after (the scheduler and the workers talk to it too)."""
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    for _ in range(calls):
        call()
    busy_cpu, busy_wall = cpu_seconds(pids) - cpu0, time.perf_counter() - t0
    cpu1 = cpu_seconds(pids)
    time.sleep(busy_wall)
    idle_cpu = cpu_seconds(pids) - cpu1
    return {"calls": calls, "busy_cpu_s": busy_cpu, "idle_cpu_s": idle_cpu, "wall_s": busy_wall,
            "per_call_ms": (busy_cpu - idle_cpu) / calls * 1000, "gross_per_call_ms": busy_cpu / calls * 1000}


def report(label: str, row: dict) -> None:
    print(f"  {label}: {row['calls']} calls in {row['wall_s']:.2f} s, "
          f"api-server CPU {row['busy_cpu_s']:.2f} s "
          f"(idle window {row['idle_cpu_s']:.2f} s) = {row['per_call_ms']:.2f} ms per call net, "
          f"{row['gross_per_call_ms']:.2f} ms gross", flush=True)


def phase_api(work: Path, upload_mb: int, rounds: int, polls: int) -> dict:
    import batch_api as deployment  # bench/batch_api.py: the same deployment its bench measures

    dep = deployment.start(work, stub_delay=1.0, dag_conf={"requests_per_shard": 5000, "concurrency": 64})
    try:
        env = {**os.environ, "AIBRIX_BATCH_BASE_URL": dep.airflow.api_url, "OPENAI_API_KEY": dep.key}
        result: dict = {}
        dep.set_paused(True)  # created batches stay queued: the upload is what is measured
        path = work / "upload.jsonl"
        deployment.write_batch_file(path, target_bytes=upload_mb * MB)
        size = path.stat().st_size
        small = work / "small.jsonl"
        deployment.write_batch_file(small, requests=10)
        measured("create", "--input", str(small), env=env)  # the api-server's lazy setup
        rows = []
        for r in range(rounds):
            code, wall, rss = measured("create", "--input", str(path), env=env)
            assert code == 0
            rows.append({"mb_s": size / MB / wall, "wall_s": wall, "peak_rss_mb": rss / MB})
            print(f"  upload round {r + 1}: {size / MB:.0f} MB in {wall:.2f} s = {rows[-1]['mb_s']:.0f} MB/s "
                  f"(create included), CLI peak RSS {rss / MB:.1f} MB", flush=True)
        result["upload"] = {"bytes": size, "mb_s": statistics.median(x["mb_s"] for x in rows), "rounds": rows}
        path.unlink()

        # Poll cost on a batch in progress.
        client = dep.client()
        for b in client.batches.list(limit=100):
            client.batches.cancel(b.id)  # the queued uploads never run
        dep.set_paused(False)
        batch_file = work / "poll.jsonl"
        deployment.write_batch_file(batch_file, requests=5000)
        batch = client.batches.create(input_file_id=client.files.create(file=open(batch_file, "rb"),
                                                                         purpose="batch").id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while True:
            current = client.batches.retrieve(batch.id)
            if current.status == "in_progress" and current.request_counts.completed > 0:
                break
            assert current.status in ("validating", "in_progress") and time.monotonic() < deadline, current
            time.sleep(1)
        pids = deployment.process_tree(dep.airflow.procs[0].pid)
        http = httpx.Client(base_url=dep.airflow.api_url, timeout=30)
        # The api-server's floor: Airflow's own cheapest route, same client, same connection reuse.
        result["floor"] = server_cpu(pids, polls, lambda: http.get("/api/v2/version").raise_for_status())
        report("GET /api/v2/version (the floor)", result["floor"])
        state = {}

        def poll() -> None:
            state["batch"] = client.batches.retrieve(batch.id)

        result["poll_early"] = server_cpu(pids, polls, poll)
        result["poll_early"]["counts"] = state["batch"].request_counts.model_dump()
        report(f"poll, {state['batch'].request_counts.completed} answered", result["poll_early"])
        while client.batches.retrieve(batch.id).request_counts.completed < 2500:
            assert time.monotonic() < deadline + 300, "the poll batch stalled"
            time.sleep(1)
        result["poll"] = server_cpu(pids, polls, poll)
        result["poll"]["counts"] = state["batch"].request_counts.model_dump()
        result["poll"]["in_progress_throughout"] = state["batch"].status == "in_progress"
        report(f"poll, {state['batch'].request_counts.completed} answered", result["poll"])
        for key in ("poll_early", "poll"):
            result[key]["over_floor_ms"] = result[key]["per_call_ms"] - result["floor"]["per_call_ms"]
        print(f"  poll over the floor: {result['poll_early']['over_floor_ms']:.2f} ms early, "
              f"{result['poll']['over_floor_ms']:.2f} ms half-way; still in progress: "
              f"{result['poll']['in_progress_throughout']}", flush=True)
        client.batches.cancel(batch.id)
        return result
    finally:
        deployment.stop(dep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="results,api")
    p.add_argument("--results-mb", type=int, default=1000)
    p.add_argument("--upload-mb", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--polls", type=int, default=200)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    phases = set(args.phases.split(","))
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-cli-", dir=REPO / ".work") as tmp:
        work = Path(tmp)
        if "results" in phases:
            print("results (stub Batch API):", flush=True)
            results["results"] = phase_results(work, args.results_mb, args.rounds)
        if "api" in phases:
            print("upload and poll (real deployment):", flush=True)
            results.update(phase_api(work, args.upload_mb, args.rounds, args.polls))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
