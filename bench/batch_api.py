"""The OpenAI-compatible Batch API under load, against a running Airflow (api-server,
scheduler, dag-processor, triggerer) whose storage root is a real SeaweedFS S3 bucket.

Three measurements, each beside a baseline taken in the same run:

  upload   ``POST /v1/files`` of a 200 MB batch file with the official ``openai`` SDK:
           MB/s into SeaweedFS, and how much the api-server's RSS (its whole process
           tree, sampled from /proc every 10 ms) grows during the upload.
           Baseline: boto3 ``upload_file`` of the same file straight to the bucket.
  cancel   a 5,000-request batch against a stub endpoint that answers each request after
           ``--stub-delay`` s and logs when requests arrive; cancelled once
           ``--cancel-after`` requests have arrived. Reported: cancel call → last new
           request to reach the endpoint, and cancel call → first ``retrieve`` that says
           ``cancelled``. The real scheduler, triggerer, dispatch task and driver run it.
  get      ``GET /v1/batches/{id}`` and ``GET /v1/batches?limit=100`` with 1,000 batches on
           record, from an asyncio/aiohttp closed-loop load generator (``--concurrency``
           clients, keep-alive). The 1,000 batches are created through the API with the
           DAG paused, so they stay queued (``validating``): real DAG runs, no task
           instances yet. The cancelled batch of the cancel phase is on record too (the
           oldest page holds it). Baseline: Airflow's own REST API for the same runs
           (``/api/v2/dags/batch_inference/dagRuns/{run_id}`` and ``?limit=100``).

    .venv/bin/python bench/batch_api.py                    # all three, ~10 min on 2 cores
    .venv/bin/python bench/batch_api.py --phases upload --upload-mb 20 --rounds 1

The load generator, the stub and SeaweedFS share the machine with Airflow, so every
figure includes their CPU; medians of ``--rounds`` are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.integration.services: the SeaweedFS starter the tests use

BUCKET = "bench-batch-api"
TENANT = "bench"
MODEL = "tiny-llama"
TERMINAL = ("completed", "failed", "expired", "cancelled")
MB = 1_000_000


# ---------------------------------------------------------------- measurement helpers (pure)
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; the sample itself, no interpolation."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least the first
    return ordered[int(min(rank, len(ordered))) - 1]


def latency_summary(seconds: list[float], wall_s: float) -> dict[str, float]:
    """p50/p99/max in milliseconds and requests per second of one load run."""
    return {
        "n": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "rps": len(seconds) / wall_s if wall_s > 0 else 0.0,
    }


def mb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / MB / seconds


def children_of(proc_root: Path) -> dict[int, list[int]]:
    """ppid → pids, from ``/proc/<pid>/stat`` (the command name may hold spaces and parens)."""
    tree: dict[int, list[int]] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def process_tree(pid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """``pid`` and all its descendants."""
    tree = children_of(proc_root)
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(tree.get(current, []))
    return sorted(out)


def rss_bytes(pids: list[int], proc_root: Path = Path("/proc")) -> int:
    """Summed VmRSS of ``pids`` (those that have exited count 0)."""
    total = 0
    for pid in pids:
        try:
            status = (proc_root / str(pid) / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
                break
    return total


class RssSampler:
    """Samples the RSS of a fixed set of processes every ``interval_s`` on a thread."""

    def __init__(self, pids: list[int], interval_s: float = 0.01) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(rss_bytes(self.pids))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(rss_bytes(self.pids))

    @property
    def peak(self) -> int:
        return max(self.samples)


def write_batch_file(path: Path, target_bytes: int | None = None, requests: int | None = None) -> int:
    """A chat-completions batch file of ``requests`` lines, or of about ``target_bytes``; the
    number of lines."""
    template = (
        '{{"custom_id": "req-{i:07d}", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {{"model": "' + MODEL + '", "max_tokens": 16, "temperature": 0.0, '
        '"messages": [{{"role": "user", "content": "item {i}: {text}"}}]}}}}\n'
    )
    text = "summarize the batch pipeline in one sentence, please, " * 4
    n = 0
    written = 0
    with open(path, "w") as fh:
        while (requests is not None and n < requests) or (
            target_bytes is not None and written < target_bytes
        ):
            block = "".join(template.format(i=i, text=text) for i in range(n, n + 1000))
            if requests is not None:
                block = "".join(block.splitlines(keepends=True)[: requests - n])
            elif written + len(block) > target_bytes:  # type: ignore[operator]
                lines = block.splitlines(keepends=True)
                block = ""
                for line in lines:
                    if written + len(block) + len(line) > target_bytes:  # type: ignore[operator]
                        break
                    block += line
                if not block:
                    break
            fh.write(block)
            written += len(block)
            n += block.count("\n")
    return n


# ---------------------------------------------------------------- the deployment
@dataclass
class Deployment:
    airflow: object  # aibrix_operators.local_airflow.AirflowDeployment
    s3: object  # tests.integration.services.S3Server
    stub_proc: subprocess.Popen
    stub_url: str
    key: str
    work: Path
    procs: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.airflow.api_url + "/openai/v1"  # type: ignore[attr-defined]

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0, timeout=600)

    def stub_stats(self) -> dict:
        with urllib.request.urlopen(self.stub_url + "/stats", timeout=10) as resp:
            return json.loads(resp.read())

    def stub_reset(self) -> None:
        req = urllib.request.Request(self.stub_url + "/reset", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def set_paused(self, paused: bool) -> None:
        airflow = self.airflow
        token = airflow.token()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 120
        while True:  # the dag-processor parses the DAG folder shortly after start
            try:
                airflow.api("PATCH", "/api/v2/dags/batch_inference", {"is_paused": paused}, token)  # type: ignore[attr-defined]
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def start(work: Path, stub_delay: float, dag_conf: dict) -> Deployment:
    from aibrix_operators.batch_api.auth import key_digest
    from aibrix_operators.local_airflow import start_airflow
    from aibrix_operators.localenv import airflow_env
    from aibrix_operators.serving.local_vllm import stop_process_group
    from tests.integration.services import start_seaweedfs

    stub = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "fake_openai.py"), "--delay", str(stub_delay)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = stub.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("PORT "), line
    stub_url = f"http://127.0.0.1:{int(line.split()[1])}"
    s3 = None
    try:
        s3 = start_seaweedfs(work / "seaweedfs", "bench-key", "bench-" + secrets.token_hex(8))
        s3.client().create_bucket(Bucket=BUCKET)
        home = work / "airflow-home"
        key = "sk-bench-" + secrets.token_hex(16)
        env = {
            **os.environ,
            **airflow_env(home),
            **s3.env(),
            "AIRFLOW__AIBRIX_BATCH__ALLOWED_ENDPOINTS": "http://127.0.0.1:*",
            "AIRFLOW__AIBRIX_BATCH__ALLOWED_STORAGE": f"s3://{BUCKET}/",
            "AIRFLOW__AIBRIX_BATCH__ALLOWED_AWS_CONN_IDS": "<default>",
            "AIRFLOW_VAR_AIBRIX_BATCH_API_KEYS": json.dumps({key_digest(key): TENANT}),
            "AIRFLOW__AIBRIX_BATCH__API_STORAGE_ROOT": f"s3://{BUCKET}/api",
            "AIRFLOW__AIBRIX_BATCH__API_MODELS": f"{MODEL}={stub_url}",
            "AIRFLOW__AIBRIX_BATCH__API_MAX_FILE_BYTES": str(209_715_200),
            "AIRFLOW__AIBRIX_BATCH__API_DAG_CONF": json.dumps(dag_conf),
        }
        airflow = start_airflow(env, home)
    except BaseException:
        if s3 is not None:
            stop_process_group(s3.proc)
        stop_process_group(stub)
        raise
    return Deployment(airflow, s3, stub, stub_url, key, work)


def stop(dep: Deployment) -> None:
    from aibrix_operators.serving.local_vllm import stop_process_group

    dep.airflow.stop()  # type: ignore[attr-defined]
    stop_process_group(dep.s3.proc)  # type: ignore[attr-defined]
    stop_process_group(dep.stub_proc)


# ---------------------------------------------------------------- phases
def phase_upload(dep: Deployment, mb: int, rounds: int) -> dict:
    client = dep.client()
    s3 = dep.s3.client()  # type: ignore[attr-defined]
    path = dep.work / f"upload-{mb}mb.jsonl"
    write_batch_file(path, target_bytes=mb * MB)
    size = path.stat().st_size
    # A first small upload: the api-server's lazy imports and clients are not the upload's cost.
    warm = dep.work / "warm.jsonl"
    write_batch_file(warm, requests=10)
    client.files.delete(client.files.create(file=warm, purpose="batch").id)
    api_pid = dep.airflow.procs[0].pid  # type: ignore[attr-defined]
    results: dict[str, list[float]] = {
        "api_mb_s": [],
        "boto3_mb_s": [],
        "rss_growth_mb": [],
        "rss_before_mb": [],
    }
    for r in range(rounds):
        t0 = time.perf_counter()
        s3.upload_file(str(path), BUCKET, f"baseline/{r}.jsonl")
        results["boto3_mb_s"].append(mb_per_s(size, time.perf_counter() - t0))
        s3.delete_object(Bucket=BUCKET, Key=f"baseline/{r}.jsonl")

        pids = process_tree(api_pid)
        before = rss_bytes(pids)
        with RssSampler(pids) as sampler:
            t0 = time.perf_counter()
            stored = client.files.create(file=path, purpose="batch")
            elapsed = time.perf_counter() - t0
        assert stored.bytes == size, (stored.bytes, size)
        head = s3.head_object(Bucket=BUCKET, Key=f"api/tenants/{TENANT}/files/{stored.id}.jsonl")
        assert head["ContentLength"] == size
        results["api_mb_s"].append(mb_per_s(size, elapsed))
        results["rss_growth_mb"].append((sampler.peak - before) / MB)
        results["rss_before_mb"].append(before / MB)
        print(
            f"  upload round {r + 1}: API {results['api_mb_s'][-1]:.1f} MB/s, boto3 "
            f"{results['boto3_mb_s'][-1]:.1f} MB/s, api-server RSS {before / MB:.0f} MB "
            f"+{results['rss_growth_mb'][-1]:.1f} MB peak ({len(pids)} processes, "
            f"{len(sampler.samples)} samples)",
            flush=True,
        )
        client.files.delete(stored.id)
    path.unlink()
    ratios = [a / b for a, b in zip(results["api_mb_s"], results["boto3_mb_s"], strict=True)]
    return {
        "bytes": size,
        **{k: statistics.median(v) for k, v in results.items()},
        "ratio": statistics.median(ratios),
        "rss_growth_max_mb": max(results["rss_growth_mb"]),
        "rounds": results,
    }


def phase_cancel(dep: Deployment, requests: int, cancel_after: int, rounds: int) -> dict:
    client = dep.client()
    path = dep.work / "cancel.jsonl"
    write_batch_file(path, requests=requests)
    file_id = client.files.create(file=path, purpose="batch").id
    out: dict[str, list[float]] = {
        "to_last_request_s": [],
        "to_cancelled_s": [],
        "sent_after_cancel": [],
        "completed": [],
    }
    batch_ids = []
    for r in range(rounds):
        dep.stub_reset()
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch_ids.append(batch.id)
        deadline = time.monotonic() + 600
        while (seen := dep.stub_stats())["requests"] < cancel_after:
            assert time.monotonic() < deadline, "dispatch did not start"
            time.sleep(0.05)
        t_cancel = time.time()
        status = client.batches.cancel(batch.id).status
        t_returned = time.time()
        while True:
            current = client.batches.retrieve(batch.id)
            if current.status in TERMINAL:
                t_done = time.time()
                break
            assert time.monotonic() < deadline + 600, f"still {current.status}"
            time.sleep(0.2)
        final = dep.stub_stats()
        counts = current.request_counts
        assert current.status == "cancelled", current.status
        assert counts.total == requests and counts.completed + counts.failed == requests, counts
        to_last = max(0.0, final["last_at"] - t_cancel)
        out["to_last_request_s"].append(to_last)
        out["to_cancelled_s"].append(t_done - t_cancel)
        out["sent_after_cancel"].append(final["requests"] - seen["requests"])
        out["completed"].append(counts.completed)
        print(
            f"  cancel round {r + 1}: cancel answered '{status}' in {t_returned - t_cancel:.2f}s; "
            f"{seen['requests']} requests had arrived, {final['requests']} in all; last new request "
            f"{to_last:.2f}s after the cancel call; 'cancelled' after {t_done - t_cancel:.1f}s; "
            f"completed {counts.completed}, failed {counts.failed}",
            flush=True,
        )
    return {"batch_ids": batch_ids, **{k: statistics.median(v) for k, v in out.items()}, "rounds": out}


async def _load(
    urls: list[str], headers: dict[str, str], concurrency: int, check: Callable[[int, bytes], None]
) -> tuple[list[float], float]:
    """Closed loop: ``concurrency`` clients, each sending the next URL when its last answer is in."""
    import aiohttp

    latencies: list[float] = []
    todo = iter(urls)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=conn) as session:

        async def worker() -> None:
            for url in todo:
                t0 = time.perf_counter()
                async with session.get(url) as resp:
                    body = await resp.read()
                latencies.append(time.perf_counter() - t0)
                check(resp.status, body)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, wall


def load(urls: list[str], headers: dict[str, str], concurrency: int, warmup: int = 20) -> dict[str, float]:
    def check(status: int, body: bytes) -> None:
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:300]!r}")

    asyncio.run(_load(urls[:warmup], headers, concurrency, check))
    latencies, wall = asyncio.run(_load(urls, headers, concurrency, check))
    return latency_summary(latencies, wall)


async def _create_many(base: str, key: str, file_id: str, n: int, concurrency: int) -> list[str]:
    import aiohttp

    ids: list[str] = []
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    left = iter(range(n))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:

        async def worker() -> None:
            for _ in left:
                async with session.post(base + "/batches", json=body) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"create: HTTP {resp.status} {data}")
                    ids.append(data["id"])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


def phase_get(
    dep: Deployment,
    batches: int,
    requests: int,
    list_requests: int,
    concurrency: int,
    rounds: int,
    extra_ids: list[str],
) -> dict:
    client = dep.client()
    dep.set_paused(True)  # runs created now stay queued: 1,000 real runs, no tasks started
    small = dep.work / "one.jsonl"
    write_batch_file(small, requests=1)
    file_id = client.files.create(file=small, purpose="batch").id
    t0 = time.perf_counter()
    created = asyncio.run(_create_many(dep.base_url, dep.key, file_id, batches, 4))
    create_s = time.perf_counter() - t0
    print(
        f"  created {len(created)} batches in {create_s:.1f}s ({len(created) / create_s:.1f}/s)", flush=True
    )
    listed = [b.id for b in client.batches.list(limit=100)]  # SDK auto-pagination: all of them
    assert len(listed) >= batches + len(extra_ids), len(listed)
    rng = random.Random(0)
    base = dep.base_url
    auth = {"Authorization": f"Bearer {dep.key}"}
    airflow = dep.airflow
    token = airflow.token()  # type: ignore[attr-defined]
    rest = airflow.api_url + "/api/v2/dags/batch_inference/dagRuns"  # type: ignore[attr-defined]
    rest_auth = {"Authorization": f"Bearer {token}"}
    run_id = {b: f"openai__{TENANT}__{b}" for b in listed}
    last_page_after = listed[-101]
    cases = {
        "get_by_id": lambda: load(
            [f"{base}/batches/{rng.choice(listed)}" for _ in range(requests)], auth, concurrency
        ),
        "airflow_rest_get_run": lambda: load(
            [f"{rest}/{run_id[rng.choice(listed)]}" for _ in range(requests)], rest_auth, concurrency
        ),
        "list_100_newest": lambda: load([f"{base}/batches?limit=100"] * list_requests, auth, concurrency),
        "list_100_oldest": lambda: load(
            [f"{base}/batches?limit=100&after={last_page_after}"] * list_requests, auth, concurrency
        ),
        "airflow_rest_list_100": lambda: load([f"{rest}?limit=100"] * list_requests, rest_auth, concurrency),
    }
    if extra_ids:
        cases["get_cancelled_by_id"] = lambda: load(
            [f"{base}/batches/{extra_ids[0]}"] * (requests // 4), auth, concurrency
        )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, case in cases.items():
            runs[name].append(case())
            s = runs[name][-1]
            print(
                f"  get round {r + 1}: {name:24s} p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  "
                f"max {s['max_ms']:7.1f} ms  {s['rps']:6.1f} req/s",
                flush=True,
            )
    medians = {
        name: {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
        for name, summaries in runs.items()
    }
    for name, summaries in runs.items():
        medians[name]["p99_worst_ms"] = max(s["p99_ms"] for s in summaries)
    return {
        "batches_on_record": len(listed),
        "create_per_s": len(created) / create_s,
        "concurrency": concurrency,
        **medians,
    }


# ---------------------------------------------------------------- report
def report(results: dict) -> list[str]:
    lines = [
        "",
        "| measurement | result (median of rounds) | baseline (same run) | target | met |",
        "|---|---|---|---|---|",
    ]
    if "upload" in results:
        u = results["upload"]
        lines.append(
            f"| upload {u['bytes'] / MB:.0f} MB, `POST /v1/files` (openai SDK) → SeaweedFS | "
            f"{u['api_mb_s']:.1f} MB/s | boto3 `upload_file` {u['boto3_mb_s']:.1f} MB/s "
            f"(API = {u['ratio']:.2f}x, median of per-round ratios) | ≥ 50 MB/s | "
            f"{'yes' if u['api_mb_s'] >= 50 else 'NO'} |"
        )
        lines.append(
            f"| api-server RSS growth during the upload (peak − before) | "
            f"{u['rss_growth_mb']:.1f} MB (max of rounds {u['rss_growth_max_mb']:.1f}) | "
            f"RSS before {u['rss_before_mb']:.0f} MB | < 50 MB | "
            f"{'yes' if u['rss_growth_max_mb'] < 50 else 'NO'} |"
        )
    if "get" in results:
        g = results["get"]
        c = g["concurrency"]
        get_base, list_base = "airflow_rest_get_run", "airflow_rest_list_100"
        for name, what, base, target in (
            ("get_by_id", "`GET /v1/batches/{id}`", get_base, 50),
            ("list_100_newest", "`GET /v1/batches?limit=100` (newest page)", list_base, 200),
            ("list_100_oldest", "`GET /v1/batches?limit=100&after=…` (oldest page)", list_base, 200),
            ("get_cancelled_by_id", "`GET /v1/batches/{id}` of the cancelled batch", get_base, 50),
        ):
            if name not in g:
                continue
            s, b = g[name], g[base]
            lines.append(
                f"| {what}, {g['batches_on_record']} on record, {c} clients | "
                f"p99 {s['p99_ms']:.1f} ms (worst round {s['p99_worst_ms']:.0f}; "
                f"p50 {s['p50_ms']:.1f}, {s['rps']:.0f} req/s) | "
                f"Airflow REST p99 {b['p99_ms']:.1f} ms (p50 {b['p50_ms']:.1f}) | "
                f"p99 < {target} ms | {'yes' if s['p99_ms'] < target else 'NO'} |"
            )
    if "cancel" in results:
        k = results["cancel"]
        lines.append(
            f"| cancel → last new request sent ({results['cancel_requests']} requests) | "
            f"{k['to_last_request_s']:.2f} s | — | < 5 s | "
            f"{'yes' if k['to_last_request_s'] < 5 else 'NO'} |"
        )
        lines.append(
            f"| cancel → `cancelled` | {k['to_cancelled_s']:.1f} s | — | < 30 s | "
            f"{'yes' if k['to_cancelled_s'] < 30 else 'NO'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="upload,cancel,get")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the upload and load measurements")
    p.add_argument("--upload-mb", type=int, default=200)
    p.add_argument("--cancel-requests", type=int, default=5000)
    p.add_argument("--cancel-after", type=int, default=1000, help="requests arrived before the cancel")
    p.add_argument("--cancel-rounds", type=int, default=2)
    p.add_argument("--stub-delay", type=float, default=1.0, help="seconds the stub takes per answer")
    p.add_argument("--concurrency", type=int, default=4, help="load generator clients")
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--get-requests", type=int, default=1000)
    p.add_argument("--list-requests", type=int, default=200)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    from aibrix_operators.localenv import WORK_DIR

    WORK_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-api-", dir=WORK_DIR))
    print(f"load: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs; work dir {work}", flush=True)
    dep = start(work, args.stub_delay, {"requests_per_shard": 5000, "concurrency": 64})
    results: dict = {"cancel_requests": args.cancel_requests}
    try:
        dep.set_paused(False)
        if "upload" in phases:
            print(f"upload: {args.upload_mb} MB, {args.rounds} rounds", flush=True)
            results["upload"] = phase_upload(dep, args.upload_mb, args.rounds)
        if "cancel" in phases:
            print(
                f"cancel: {args.cancel_requests} requests, stub delay {args.stub_delay}s, cancel after "
                f"{args.cancel_after} arrived, {args.cancel_rounds} rounds",
                flush=True,
            )
            results["cancel"] = phase_cancel(dep, args.cancel_requests, args.cancel_after, args.cancel_rounds)
        if "get" in phases:
            print(
                f"get: {args.batches} batches, {args.concurrency} clients, {args.rounds} rounds", flush=True
            )
            results["get"] = phase_get(
                dep,
                args.batches,
                args.get_requests,
                args.list_requests,
                args.concurrency,
                args.rounds,
                results.get("cancel", {}).get("batch_ids", []),
            )
    finally:
        stop(dep)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load after: {os.getloadavg()[0]:.2f} (1 min)")
    print("\n".join(report(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
