"""Dedicated mode at scale: a large batch through the whole batch_inference DAG, zero-latency stub.

Measures what a new user would see running a big file: `airflow dags test batch_inference`
(every task in one process, one after another; the trigger mode measured) with N requests in
shards of M against `tests/fake_openai.py` (its RawStub: a raw-asyncio OpenAI stub that answers at once,
so the pipeline is measured, not a model). Reports wall time, requests/s, the peak RSS of the
`airflow dags test` process (its `ru_maxrss`), each task's duration from the run's log, and
checks that every request was answered exactly once.

    .venv/bin/python bench/dag_at_scale.py                      # 1,000,000 requests, 20 shards
    .venv/bin/python bench/dag_at_scale.py --requests 200000 --per-shard 50000
    .venv/bin/python bench/dag_at_scale.py --profile-shard      # where one shard's time goes
    .venv/bin/python bench/dag_at_scale.py --requests 10000000 --line-bytes 1000   # 10M, ~10 GB

``--trigger scheduler`` runs the same DAG on a running Airflow instead (api-server, scheduler,
dag-processor, triggerer; LocalExecutor), as a deployment does: each task in its own process. It
reports each step's largest task process: peak RSS (``VmHWM``, which counts the pages a task
process shares with the scheduler it was forked from) and peak PSS (shared pages split among
their sharers, sampled every 0.5 s), matched to task instances by the pids Airflow records.

``--line-bytes`` pads each request's prompt so its line is about that long (default: no padding,
~188 bytes). Besides the process's ``ru_maxrss`` the bench samples its VmRSS every 0.2 s and
reports each step's peak (validate, split, the dispatches, merge) from the run log's task times.

``--profile-shard`` runs the driver CLI on one shard of --per-shard requests under cProfile
(not the DAG) and prints the shares of its CPU time by where it was spent: aiohttp's client,
JSON, the checkpoint/result writer, the driver's own code, the event loop.

Targets (issue 21): 1,000,000 requests in < 180 s with < 300 MB peak RSS.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import resource
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "plugins"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver_stub import StubProcess, chat_line  # noqa: E402

from aibrix_operators.localenv import airflow_env  # noqa: E402

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def write_input(path: Path, n: int, line_bytes: int = 0) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            content = f"question {i}: what is {i % 97} + 3?"
            if line_bytes > 190:  # the rest of the line is ~150 bytes
                content += " " + "context " * ((line_bytes - 190) // 8)
            fh.write(chat_line(f"r{i}", content, 8))


def _stub_cpu() -> int | None:
    """The stub's own core (CPU 1) when the machine has two."""
    return 1 if (os.cpu_count() or 1) > 1 else None


def count_output(out: Path, n: int) -> str:
    seen: set[str] = set()
    dupes = 0
    with open(out / "output.jsonl", "rb") as fh:
        for line in fh:
            cid = json.loads(line)["custom_id"]
            dupes += cid in seen
            seen.add(cid)
    missing = n - len(seen)
    verdict = " OK" if not dupes and not missing else ""
    return f"{len(seen):,} answered, {dupes} twice, {missing} missing{verdict}"


TASK_LINE = re.compile(r"^(\S+Z) .*\[DAG TEST\] (starting|end task) task_id=(\S+) map_index=(-?\d+)")


def task_spans(log: Path) -> list[tuple[str, datetime, datetime]]:
    """(task_id, start, end) of every task instance, from `airflow dags test`'s start/end lines."""
    started: dict[tuple[str, str], datetime] = {}
    spans = []
    for line in log.read_text(errors="replace").splitlines():
        m = TASK_LINE.match(line)
        if not m:
            continue
        ts = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
        key = (m.group(3), m.group(4))
        if m.group(2) == "starting":
            started[key] = ts
        elif key in started:
            spans.append((key[0], started.pop(key), ts))
    return spans


STEPS = ("validate", "split", "dispatch", "merge")


class RssTrace(threading.Thread):
    """VmRSS of one process every ``interval_s``, with the time of each sample (UTC)."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[datetime, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while not self.done.wait(self.interval_s):
            try:
                kb = next(int(x.split()[1]) for x in status.read_text().splitlines() if x.startswith("VmRSS"))
            except (OSError, StopIteration):
                return
            self.samples.append((datetime.now(UTC), kb / 1024))


def step_peaks(spans: list[tuple[str, datetime, datetime]], samples: list[tuple[datetime, float]]
               ) -> dict[str, float]:
    """The largest VmRSS sample (MB) inside each task's spans, by task_id."""
    peaks: dict[str, float] = {}
    for task_id, start, end in spans:
        inside = [mb for ts, mb in samples if start <= ts <= end]
        if inside:
            peaks[task_id] = max(peaks.get(task_id, 0.0), *inside)
    return peaks


class ProcessPeaks(threading.Thread):
    """Every ``interval_s``: each descendant of ``root``'s VmHWM and PSS, the largest seen per pid."""

    def __init__(self, root: int, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.hwm: dict[int, float] = {}
        self.pss: dict[int, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.wait(self.interval_s):
            try:
                pids = [p.pid for p in psutil.Process(self.root).children(recursive=True)]
            except psutil.Error:
                return
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                except OSError:
                    continue
                hwm = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM")), 0)
                pss = next((int(x.split()[1]) for x in rollup.splitlines() if x.startswith("Pss:")), 0)
                self.hwm[pid] = max(self.hwm.get(pid, 0.0), hwm / 1024)
                self.pss[pid] = max(self.pss.get(pid, 0.0), pss / 1024)


def run_scheduled(conf: dict, env: dict[str, str]) -> tuple[int, float, dict[str, dict[str, float]]]:
    """The DAG on a running Airflow: (exit code, wall seconds, step -> its largest task process's
    peak RSS and PSS and how many of its task processes were sampled)."""
    from aibrix_operators.local_airflow import start_airflow, trigger_and_wait

    deployment = start_airflow(env, Path(env["AIRFLOW_HOME"]))
    try:
        peaks = ProcessPeaks(deployment.procs[1].pid)  # the scheduler: its executor runs the tasks
        peaks.start()
        t0 = time.monotonic()
        run = trigger_and_wait(deployment, "batch_inference", conf, timeout_s=4 * 3600)
        wall = time.monotonic() - t0
        peaks.done.set()
        peaks.join()
        token = deployment.token()
        path = f"/api/v2/dags/batch_inference/dagRuns/{run['dag_run_id']}/taskInstances"
        tis: list[dict] = []
        while len(page := deployment.api("GET", f"{path}?limit=100&offset={len(tis)}", token=token)
                  ["task_instances"]) > 0:
            tis += page
        steps: dict[str, dict[str, float]] = {}
        for ti in tis:
            if ti["task_id"] not in STEPS or ti["pid"] not in peaks.hwm:
                continue
            step = steps.setdefault(ti["task_id"], {"rss_mb": 0.0, "pss_mb": 0.0, "sampled": 0})
            step["rss_mb"] = max(step["rss_mb"], peaks.hwm[ti["pid"]])
            step["pss_mb"] = max(step["pss_mb"], peaks.pss[ti["pid"]])
            step["sampled"] += 1
        return (0 if run["state"] == "success" else 1), wall, steps
    finally:
        deployment.stop()


def task_seconds(log: Path) -> dict[str, float]:
    """Seconds per task (mapped tasks summed) from `airflow dags test`'s start/end lines."""
    out: dict[str, float] = {}
    for task_id, start, end in task_spans(log):
        out[task_id] = out.get(task_id, 0.0) + (end - start).total_seconds()
    return out


def run_dag(args: argparse.Namespace) -> int:
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    inp = work / (f"input-{args.requests}.jsonl" if not args.line_bytes
                  else f"input-{args.requests}-{args.line_bytes}b.jsonl")
    if not inp.exists() or sum(1 for _ in open(inp, "rb")) != args.requests:
        print(f"writing {args.requests:,} requests to {inp} ...", flush=True)
        write_input(inp, args.requests, args.line_bytes)
    out = work / f"out-{time.time_ns()}"
    env = airflow_env()
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True)
    log = work / "dag.log"
    with StubProcess(_stub_cpu()) as stub:
        conf = {
            "input_uri": str(inp),
            "output_uri": str(out),
            "endpoint": f"http://127.0.0.1:{stub.port}",
            "requests_per_shard": args.per_shard,
            "concurrency": args.concurrency,
            "model": "tiny-llama",
            "max_requests": args.requests,
            "max_file_bytes": max(inp.stat().st_size, 200 * 1024 * 1024),
        }  # past OpenAI's 50,000 per file and 200 MB: the trigger raises them
        print(
            f"{'airflow dags test' if args.trigger == 'dags-test' else 'REST, a running Airflow:'} "
            f"batch_inference: {args.requests:,} requests, shards of {args.per_shard:,}, "
            f"concurrency {args.concurrency} (log: {log})",
            flush=True,
        )
        if args.trigger == "scheduler":
            rc, wall, steps = run_scheduled(conf, env)
            print(f"wall {wall:.1f} s, {args.requests / wall:,.0f} req/s (triggered through the REST API)")
            if rc != 0:
                print("the DAG run failed")
                return 1
            print(f"output: {count_output(out, args.requests)}")
            print("largest task process per step (peak RSS / peak PSS, MB; task processes sampled): "
                  + ", ".join(f"{k} {v['rss_mb']:.0f} / {v['pss_mb']:.0f} ({v['sampled']:.0f})"
                              for k, v in steps.items()))
            if args.json:
                args.json.write_text(json.dumps({"requests": args.requests, "wall_s": wall, "steps": steps}))
            return 0
        t0 = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [AIRFLOW, "dags", "test", "batch_inference", "-c", json.dumps(conf)],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
            trace = RssTrace(proc.pid)
            trace.start()
            rc = proc.wait()
            trace.done.set()
            trace.join()
        wall = time.monotonic() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if rc != 0:
        print(f"the DAG run failed (exit {rc}); see {log}")
        return 1
    print(
        f"wall {wall:.1f} s, {args.requests / wall:,.0f} req/s; peak RSS {peak_mb:.0f} MB "
        f"(the largest process: airflow dags test)"
    )
    print(f"output: {count_output(out, args.requests)}")
    tasks = task_seconds(log)
    print(
        "task seconds (mapped tasks summed): "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(tasks.items(), key=lambda kv: -kv[1]) if v >= 0.05)
    )
    peaks = step_peaks(task_spans(log), trace.samples)
    if args.trace:  # every sample and span, to see where in a step the memory went
        args.trace.write_text(json.dumps({
            "samples": [(ts.isoformat(), mb) for ts, mb in trace.samples],
            "spans": [(t, a.isoformat(), b.isoformat()) for t, a, b in task_spans(log)]}))
    print("peak VmRSS per step (MB, sampled every 0.2 s): "
          + ", ".join(f"{k} {peaks[k]:.0f}" for k in STEPS if k in peaks))
    if args.requests >= 1_000_000:
        ok = wall < 180 and peak_mb < 300
        print(f"targets (< 180 s, < 300 MB): {'met' if ok else 'NOT met'}")
    return 0


# Where a profiled function's own time is counted, by the file it is defined in.
BUCKETS = [
    ("aiohttp (client, HTTP parsing, connector)", ("aiohttp/", "multidict", "yarl/")),
    ("JSON (orjson/json)", ("orjson", "json/")),
    ("checkpoint and result writing", ("driver/checkpoint.py", "batch/shard_results.py", "storage.py")),
    ("the driver's own code", ("aibrix_operators/",)),
    ("asyncio event loop", ("asyncio/", "uvloop", "selectors.py", "<built-in method select")),
]


def profile_shard(args: argparse.Namespace) -> int:
    import asyncio

    from aibrix_operators.driver.config import DriverConfig
    from aibrix_operators.driver.runner import run_shard
    from aibrix_operators.storage import LocalStorage

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    shard = work / f"shard-{args.per_shard}.jsonl"
    write_input(shard, args.per_shard)
    results = work / f"results-{time.time_ns()}"
    with StubProcess(_stub_cpu()) as stub:
        config = DriverConfig(
            endpoint=f"http://127.0.0.1:{stub.port}", concurrency=args.concurrency, api_key_env=None
        )
        prof = cProfile.Profile()
        t0 = time.process_time()
        prof.enable()
        outcome = asyncio.run(run_shard(LocalStorage(), str(shard), str(results), config))
        prof.disable()
        cpu = time.process_time() - t0
    print(
        f"one shard of {args.per_shard:,}: {outcome.completed:,} completed, {outcome.failed} failed; "
        f"{cpu:.1f} CPU-s under cProfile ({cpu / args.per_shard * 1e6:.0f} us/request)"
    )
    stats = pstats.Stats(prof)
    totals: dict[str, float] = {name: 0.0 for name, _ in BUCKETS}
    other = 0.0
    for (filename, _, func), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{filename} {func}"
        for name, needles in BUCKETS:
            if any(n in where for n in needles):
                totals[name] += tottime
                break
        else:
            other += tottime
    grand = sum(totals.values()) + other
    for name, t in [*totals.items(), ("everything else (builtins, ssl, socket, gc)", other)]:
        print(f"  {name:<46} {t:6.2f} s  {t / grand:6.1%}")
    stats.sort_stats("tottime").print_stats(15)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--per-shard", type=int, default=50_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--line-bytes", type=int, default=0, help="pad each line to about this many bytes")
    p.add_argument("--trace", type=Path, help="write the VmRSS samples and task spans here (JSON)")
    p.add_argument("--trigger", choices=("dags-test", "scheduler"), default="dags-test")
    p.add_argument("--json", type=Path, help="--trigger scheduler: write the figures here")
    # Under .work: the local deployment's default allow-list lets a trigger write only there.
    p.add_argument("--workdir", type=Path, default=REPO / ".work" / "bench" / "dag-at-scale")
    p.add_argument("--profile-shard", action="store_true", help="profile one shard of the driver instead")
    args = p.parse_args()
    return profile_shard(args) if args.profile_shard else run_dag(args)


if __name__ == "__main__":
    sys.exit(main())
