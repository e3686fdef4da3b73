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
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "plugins"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from driver_stub import StubProcess  # noqa: E402

from aibrix_operators.localenv import airflow_env  # noqa: E402

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def write_input(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(
                json.dumps(
                    {
                        "custom_id": f"r{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": "tiny-llama",
                            "max_tokens": 8,
                            "messages": [{"role": "user", "content": f"question {i}: what is {i % 97} + 3?"}],
                        },
                    },
                    separators=(",", ":"),
                )
                + "\n"
            )


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


def task_seconds(log: Path) -> dict[str, float]:
    """Seconds per task (mapped tasks summed) from `airflow dags test`'s start/end lines."""
    pat = re.compile(r"^(\S+Z) .*\[DAG TEST\] (starting|end task) task_id=(\S+) map_index=(-?\d+)")
    started: dict[tuple[str, str], datetime] = {}
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = pat.match(line)
        if not m:
            continue
        ts = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
        key = (m.group(3), m.group(4))
        if m.group(2) == "starting":
            started[key] = ts
        elif key in started:
            out[key[0]] = out.get(key[0], 0.0) + (ts - started.pop(key)).total_seconds()
    return out


def run_dag(args: argparse.Namespace) -> int:
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    inp = work / f"input-{args.requests}.jsonl"
    if not inp.exists() or sum(1 for _ in open(inp, "rb")) != args.requests:
        print(f"writing {args.requests:,} requests to {inp} ...", flush=True)
        write_input(inp, args.requests)
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
        }  # past OpenAI's 50,000 per file: the trigger raises it
        print(
            f"airflow dags test batch_inference: {args.requests:,} requests, shards of {args.per_shard:,}, "
            f"concurrency {args.concurrency} (log: {log})",
            flush=True,
        )
        t0 = time.monotonic()
        with open(log, "w") as fh:
            rc = subprocess.run(
                [AIRFLOW, "dags", "test", "batch_inference", "-c", json.dumps(conf)],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            ).returncode
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
    # Under .work: the local deployment's default allow-list lets a trigger write only there.
    p.add_argument("--workdir", type=Path, default=REPO / ".work" / "bench" / "dag-at-scale")
    p.add_argument("--profile-shard", action="store_true", help="profile one shard of the driver instead")
    args = p.parse_args()
    return profile_shard(args) if args.profile_shard else run_dag(args)


if __name__ == "__main__":
    sys.exit(main())
