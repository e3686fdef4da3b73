"""Batch on a live fleet: online TTFT and batch throughput, four ways, one server, one trace.

One vLLM CPU server (``--scheduling-policy priority``, ``--max-num-seqs S`` so a burst saturates
it) serves an online trace of bursts (closed-loop clients, more than S at once) alternating
with near-idle phases (one request every few seconds), while a batch is always available.
Scenarios, same server, same trace, one run:

  0 online only (the baseline)
  1 batch as plain requests at fixed concurrency, no priority (a user without this feature)
  2 today's driver: dedicated mode, fixed concurrency, no priority
  3 shared mode: the driver with the batch priority and the adaptive limit (capacity/)
  online@router  the baseline with the router in front (what the router scenario's online
          requests pay for the extra hop)
  router  shared mode with online and batch traffic both through the P/D router in front of the
          server (``--online-first S --preempt-batch on``): an online request that finds the
          router full takes a forwarded batch request's slot at once (vLLM aborts that one; the
          driver sends it again), where the driver's controller reacts only at its next tick
  online@gate, gate  the baseline and shared mode against a second server started with the
          online-first middleware (``serving/online_first.py``): the same decision as the
          router's, made inside vLLM's API server, so a shared endpoint needs no router for it

plus ``idle``: the dedicated driver alone on the idle server, the reference for batch
throughput. Online requests stream, so TTFT is the time to their first chunk; they run in a
process of their own (the batch side's CPU must not delay their clocks). Batch completions are
sampled from the driver's counters (scenario 1: its own) twice a second.

    .venv/bin/python bench/shared_capacity.py [--cycles 3] [--burst-s 10] [--idle-s 10]
        [--max-num-seqs 4] [--burst-clients 8] [--batch-concurrency 16] [--plot bench/shared_capacity.png]

Prints, per scenario, online TTFT p50/p99 in bursts and in idle phases, batch completions per
idle phase and in all, and the two issue-21 ratios: shared burst p99 / baseline burst p99
(target ≤ 1.10) and shared idle-phase batch rate / dedicated idle rate (target ≥ 0.80).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from aibrix_operators.capacity import controller as shared_capacity
from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.metrics import COLLECTOR
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.localenv import WORK_DIR
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec, free_port
from aibrix_operators.storage import LocalStorage

MODEL = WORK_DIR / "models" / "tiny-llama"
NAME = "tiny-llama"
ONLINE_TOKENS = 16
BATCH_TOKENS = 32
POISSON_SEED = 42


def phases(cycles: int, burst_s: float, idle_s: float,
           poisson: bool = False) -> list[tuple[str, float, float]]:
    """(kind, start, end) seconds from the trace's start: burst, idle, burst, idle, ...; or, for the
    Poisson trace, one phase as long as those cycles."""
    if poisson:
        return [("poisson", 0.0, cycles * (burst_s + idle_s))]
    out, t = [], 0.0
    for _ in range(cycles):
        out.append(("burst", t, t + burst_s))
        out.append(("idle", t + burst_s, t + burst_s + idle_s))
        t += burst_s + idle_s
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# -- the online side (its own process) ----------------------------------------------------------
async def _online_request(session: aiohttp.ClientSession, url: str, i: int,
                          t0: float) -> tuple[float, float, float | None]:
    """(send time from the trace's start, TTFT, TPOT): TPOT is the mean time between the stream's
    token events after the first (vLLM sends one ``data:`` event a token)."""
    body = {"model": NAME, "prompt": f"online user {i}: how does the batch pipeline work?",
            "max_tokens": ONLINE_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, resp.status
        async for line in resp.content:
            if line.startswith(b"data: {"):
                last = time.monotonic()
                first = first or last
                tokens += 1
    first = first or time.monotonic()
    tpot = (last - first) / (tokens - 1) if last is not None and tokens > 1 else None
    return sent - t0, first - sent, tpot


async def _online_trace(url: str, trace: list[tuple[str, float, float]], burst_clients: int,
                        idle_gap_s: float, start_at: float) -> list[tuple[float, float, float | None]]:
    """(send time from trace start, TTFT, TPOT) of every online request."""
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    samples: list[tuple[float, float, float | None]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        counter = 0
        for kind, start, end in trace:
            await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
            if kind == "poisson":
                # Open loop: arrivals at exponential gaps (mean idle_gap_s), each in its own task,
                # whatever the server's state (a chat product's users do not wait for each other).
                rng = random.Random(POISSON_SEED)
                pending = []
                at = start + rng.expovariate(1 / idle_gap_s)
                while at < end:
                    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                    counter += 1
                    pending.append(asyncio.ensure_future(_online_request(session, url, counter, t0)))
                    at += rng.expovariate(1 / idle_gap_s)
                samples.extend(await asyncio.gather(*pending))
            elif kind == "burst":
                async def client(end: float = end) -> None:
                    nonlocal counter
                    while time.monotonic() - t0 < end:
                        counter += 1
                        samples.append(await _online_request(session, url, counter, t0))
                await asyncio.gather(*(client() for _ in range(burst_clients)))
            else:
                while time.monotonic() - t0 + idle_gap_s < end:
                    counter += 1
                    samples.append(await _online_request(session, url, counter, t0))
                    await asyncio.sleep(idle_gap_s)
    return samples


def _online_process(url: str, trace: list, burst_clients: int, idle_gap_s: float, start_at: float,
                    out: Any) -> None:
    out.put(asyncio.run(_online_trace(url, trace, burst_clients, idle_gap_s, start_at)))


# -- the batch side -----------------------------------------------------------------------------
def write_shard(path: Path, n: int) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            body = {"model": NAME, "prompt": f"batch item {i}: summarize the nightly evaluation",
                    "max_tokens": BATCH_TOKENS, "temperature": 0.0, "ignore_eos": True}
            fh.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                                 "body": body}) + "\n")


async def _plain_batch(url: str, shard: Path, concurrency: int, stop_at: float, done: list[int]) -> None:
    """Scenario 1: what a user writes without this project: a fixed pool of plain requests."""
    lines = iter(shard.read_text().splitlines())
    async with aiohttp.ClientSession() as session:
        async def worker() -> None:
            for line in lines:
                if time.monotonic() >= stop_at:
                    return
                async with session.post(url + "/v1/completions", json=json.loads(line)["body"]) as r:
                    await r.read()
                    if r.status == 200:
                        done[0] += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _driver_batch(url: str, shard: Path, work: Path, concurrency: int, duration_s: float,
                        capacity: SharedCapacity | None) -> None:
    cancel = work / "CANCEL"
    config = DriverConfig(endpoint=url, concurrency=concurrency, api_key_env=None, cancel_uri=str(cancel),
                          cancel_poll_s=0.2, progress_interval_s=3600, capacity=capacity)

    async def stop_later() -> None:
        await asyncio.sleep(duration_s)
        cancel.write_text("stop\n")  # the driver's own cancel: no new request after it

    stopper = asyncio.create_task(stop_later())
    try:
        await run_shard(LocalStorage(), str(shard), str(work / "results"), config)
    finally:
        stopper.cancel()


async def run_scenario(name: str, url: str, args: argparse.Namespace, trace: list, shard: Path,
                       work: Path, with_online: bool = True) -> dict[str, Any]:
    duration = trace[-1][2]
    queue: Any = mp.Queue()
    start_at = time.time() + 1.0
    proc = None
    if with_online:
        proc = mp.Process(target=_online_process, args=(url, trace, args.burst_clients, args.idle_gap_s,
                                                         start_at, queue))
        proc.start()
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    completions: list[tuple[float, float]] = []  # (time from trace start, batch completions so far)
    limits: list[tuple[float, int]] = []
    plain_done = [0]
    base = COLLECTOR.totals()["completed"]

    async def sample() -> None:
        while True:
            now = time.monotonic() - t0
            total = plain_done[0] if name == "plain" else COLLECTOR.totals()["completed"] - base
            completions.append((now, total))
            for ctl in shared_capacity.REGISTRY.live():
                limits.append((now, ctl.limiter.limit))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    try:
        if name == "plain":
            await _plain_batch(url, shard, args.batch_concurrency, time.monotonic() + duration, plain_done)
        elif name in ("dedicated", "idle"):
            await _driver_batch(url, shard, work / name, args.batch_concurrency, duration, None)
        elif name.split("+")[0] in ("shared", "router", "gate"):
            capacity = SharedCapacity(target_inflight=args.max_num_seqs, tick_s=args.tick_s,
                                      batch_queue=args.batch_queue)
            await _driver_batch(url, shard, work / name, args.batch_concurrency, duration, capacity)
        else:
            await asyncio.sleep(duration)
    finally:
        sampler.cancel()
    online = queue.get() if proc is not None else []
    if proc is not None:
        proc.join()
    return {"name": name, "online": online, "completions": completions, "limits": limits}


def summarize(result: dict[str, Any], trace: list) -> dict[str, Any]:
    def in_phase(t: float, kind: str) -> bool:
        return any(k == kind and s <= t < e for k, s, e in trace)

    burst = [ttft for sent, ttft, _ in result["online"] if in_phase(sent, "burst")]
    idle = [ttft for sent, ttft, _ in result["online"] if in_phase(sent, "idle")]
    whole = [ttft for _, ttft, _ in result["online"]]
    tpots = [tpot for _, _, tpot in result["online"] if tpot is not None]
    comp = result["completions"]

    def done_at(t: float) -> float:
        before = [c for s, c in comp if s <= t]
        return before[-1] if before else 0.0

    idle_counts = [done_at(e) - done_at(s) for k, s, e in trace if k == "idle"]
    idle_time = sum(e - s for k, s, e in trace if k == "idle")
    return {
        "scenario": result["name"], "online_requests": len(result["online"]),
        "burst_ttft_p50_ms": _ms(percentile(burst, 50)), "burst_ttft_p99_ms": _ms(percentile(burst, 99)),
        "idle_ttft_p50_ms": _ms(percentile(idle, 50)), "idle_ttft_p99_ms": _ms(percentile(idle, 99)),
        "ttft_p50_ms": _ms(percentile(whole, 50)), "ttft_p99_ms": _ms(percentile(whole, 99)),
        "tpot_p50_ms": _ms(percentile(tpots, 50)), "tpot_p99_ms": _ms(percentile(tpots, 99)),
        "batch_per_idle_phase": [round(c) for c in idle_counts],
        "batch_idle_rate": round(sum(idle_counts) / idle_time, 2) if idle_time else None,
        "batch_total": round(comp[-1][1]) if comp else 0,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def plot(results: list[dict[str, Any]], trace: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 10))
    top = fig.add_subplot(3, 1, 1)
    bottom = fig.add_subplot(3, 1, 2, sharex=top)
    bars = fig.add_subplot(3, 1, 3)
    for ax in (top, bottom):
        for kind, s, e in trace:
            if kind == "burst":
                ax.axvspan(s, e, color="tab:red", alpha=0.08)
    for i, r in enumerate(results):
        color = f"C{i % 10}"  # one colour a scenario in both panels
        if r["completions"]:
            top.plot([t for t, _ in r["completions"]], [c for _, c in r["completions"]], label=r["name"],
                     color=color)
        if r["online"]:
            window = 2.0
            ends = [trace[-1][2] * i / 60 for i in range(1, 61)]
            p99 = [percentile([x for s, x, _ in r["online"] if e - window <= s < e], 99) for e in ends]
            bottom.plot(ends, [None if v is None else v * 1000 for v in p99], label=r["name"], color=color)
    top.set_ylabel("batch requests completed")
    top.set_title("batch completions over time (bursts shaded)")
    top.legend(loc="upper left")
    bottom.set_ylabel("online TTFT p99, 2 s windows (ms)")
    bottom.set_xlabel("seconds from the trace's start")
    bottom.set_yscale("log")
    bottom.legend(loc="upper left")
    # Each scenario's online TTFT p99 in bursts, in idle phases and over the whole trace.
    online = [r for r in results if r["online"]]
    rows = [summarize(r, trace) for r in online]
    kinds = [("burst_ttft_p99_ms", "bursts"), ("idle_ttft_p99_ms", "idle phases"),
             ("ttft_p99_ms", "whole trace")]
    width = 0.8 / len(kinds)
    slots = range(len(rows))
    for k, (key, label) in enumerate(kinds):
        bars.bar([i + k * width for i in slots], [row[key] or 0 for row in rows], width, label=label)
    bars.set_xticks([i + width for i in slots], [r["name"] for r in online], rotation=20, fontsize=8)
    bars.set_ylabel("online TTFT p99 (ms)")
    bars.set_yscale("log")
    bars.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (the affinity call moves one thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


@contextmanager
def engine_isolated(server: VLLMServer, engine_cpu: int | None):  # -> Iterator[int | None]
    """Keep one core for the engine: vLLM's engine processes run on ``engine_cpu`` alone; its API
    server, this process and everything it starts while inside (the online clients, the driver,
    the router) run on the other cores.

    vLLM's CPU backend binds its compute worker (``VLLM::Worker``) to one core and reserves the
    other for the rest of the server (``VLLM_CPU_OMP_THREADS_BIND=auto``: "core ids=[0],
    reserved_cpus=[1]"), but nothing keeps anything else off the worker's core: on this 2-core
    VM the engine core's scheduler, the API server, the load generator and the driver all land
    there too, and every slice they take stalls a forward pass (in every scenario, but more
    with more client-side work). On a GPU the forward pass does not share a core with its
    clients, so the bench keeps them apart: the worker stays where vLLM put it, the engine
    core process joins it, and the rest moves to the reserved core.
    """
    if engine_cpu is None or server.proc is None or (os.cpu_count() or 1) < 2:
        yield None
        return
    import psutil

    host_cpus = set(range(os.cpu_count() or 1)) - {engine_cpu}
    engines = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "EngineCor" in p.name()]
    if not engines:
        raise RuntimeError("no VLLM::EngineCore process under the server: cannot isolate it")
    mine = os.sched_getaffinity(0)
    for engine in engines:
        _pin_process(engine.pid, {engine_cpu})
    _pin_process(server.proc.pid, host_cpus)
    _pin_process(os.getpid(), host_cpus)
    try:
        yield engine_cpu
    finally:
        _pin_process(os.getpid(), mine)  # the next server's start sees the whole machine


@contextmanager
def online_first_router(decode_url: str, slots: int, reserve: int = 0,
                        quiet_s: float = 1.0):  # -> Iterator[str]
    """The router process (the image's entrypoint) in front of the server, online first (with
    ``reserve`` slots kept from batch while online traffic is recent)."""
    port = free_port()
    cmd = [sys.executable, "-m", "aibrix_operators.router", "--host", "127.0.0.1", "--port", str(port),
           "--decode", decode_url, "--health-interval-s", "0.5", "--online-first", str(slots),
           "--preempt-batch", "on", "--online-reserve", str(reserve),
           "--online-quiet-s", str(quiet_s)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.HTTPError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the router did not become healthy") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


async def _run_on_server(args: argparse.Namespace, names: list[str], trace: list, work: Path,
                         online_first: bool, reserve: bool = False) -> list[dict[str, Any]]:
    env = ({"AIBRIX_ONLINE_RESERVE": str(args.online_reserve),
            "AIBRIX_ONLINE_QUIET_S": str(args.online_quiet_s)} if reserve else {})
    spec = VLLMServerSpec(model=str(args.model), served_model_name=NAME, scheduling_policy="priority",
                          online_first=online_first, extra_args=["--max-num-seqs", str(args.max_num_seqs)],
                          env=env)
    results = []
    with VLLMServer(spec) as server:
        shard = work / "shard.jsonl"
        # Warm the server (first requests compile and allocate).
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                await _online_request(session, server.base_url, 0, time.monotonic())
        with engine_isolated(server, None if args.engine_cpu < 0 else args.engine_cpu) as engine_cpu:
            print(f"engine on CPU {engine_cpu}, everything else on the others" if engine_cpu is not None
                  else "engine not isolated", flush=True)
            for name in names:
                print(f"-- scenario {name}", flush=True)
                with_online = name != "idle"
                if "router" in name:
                    reserve_slots = 0 if name != "router+reserve" else (
                        args.max_num_seqs if args.online_reserve == "all" else int(args.online_reserve))
                    with online_first_router(server.base_url, args.max_num_seqs, reserve_slots,
                                             args.online_quiet_s) as url:
                        results.append(await run_scenario(name, url, args, trace, shard, work, with_online))
                else:
                    results.append(await run_scenario(name, server.base_url, args, trace, shard, work,
                                                      with_online))
                print(json.dumps(summarize(results[-1], trace)), flush=True)
    return results


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    trace = phases(args.cycles, args.burst_s, args.idle_s, args.trace == "poisson")
    results = []
    with tempfile.TemporaryDirectory(prefix="shared-capacity-") as tmp:
        work = Path(tmp)
        write_shard(work / "shard.jsonl", args.batch_requests)
        # Scenarios on a gated server run after the others, on a server of their own: with the
        # online-first middleware, then with it and the online reserve.
        plain = [n for n in args.scenarios if "gate" not in n]
        gated = [n for n in args.scenarios if "gate" in n and "+reserve" not in n]
        reserved = [n for n in args.scenarios if "gate+reserve" in n]
        servers = ((plain, False, False), (gated, True, False), (reserved, True, True))
        for names, online_first, reserve in servers:
            if names:
                results += await _run_on_server(args, names, trace, work, online_first, reserve)
    return results


# Each shared scenario against the online-only run on the same path (online#2: the first baseline again).
BASELINES = {"plain": "online", "dedicated": "online", "shared": "online", "router": "online@router",
             "router+reserve": "online@router", "gate": "online@gate", "gate+reserve": "online@gate+reserve"}
SHARED = ("shared", "router", "router+reserve", "gate", "gate+reserve")


def ratios(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The issue-42 ratios: online TTFT p99 in bursts, idle phases and the whole trace, and TPOT
    p99, each against its online-only baseline (target <= 1.10); idle-phase batch rate against
    the dedicated driver on an idle server (target >= 0.80)."""
    lines = []
    for name, base_name in BASELINES.items():
        bases = [rows[b] for b in (base_name, base_name + "#2") if b in rows]
        if name not in rows or not bases:
            continue
        parts = []
        for key, label in (("burst_ttft_p99_ms", "burst"), ("idle_ttft_p99_ms", "idle"),
                           ("ttft_p99_ms", "whole"), ("tpot_p99_ms", "TPOT")):
            base = [b[key] for b in bases if b[key]]
            if rows[name][key] and base:
                parts.append(f"{label} {rows[name][key] / (sum(base) / len(base)):.2f}")
        target = "  (target <= 1.10 each)" if name in SHARED else ""
        lines.append(f"p99 {name}/{base_name}: {', '.join(parts)}{target}")
    idle_ref = rows.get("idle", {}).get("batch_idle_rate")
    for name in SHARED:
        if idle_ref and name in rows and rows[name]["batch_idle_rate"] is not None:
            lines.append(f"idle-phase batch rate {name}/dedicated-on-idle-server: "
                         f"{rows[name]['batch_idle_rate'] / idle_ref:.2f}  (target >= 0.80)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--burst-s", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--idle-gap-s", type=float, default=3.0, help="seconds between online requests when idle")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--burst-clients", type=int, default=8)
    p.add_argument("--batch-concurrency", type=int, default=16)
    p.add_argument("--batch-requests", type=int, default=50_000)
    p.add_argument("--tick-s", type=float, default=0.25, help="shared mode's controller tick")
    p.add_argument("--batch-queue", type=int, default=SharedCapacity.batch_queue,
                   help="shared mode's batch requests allowed to wait at the server beyond the headroom")
    p.add_argument("--scenarios", nargs="+",
                   default=["online", "plain", "dedicated", "shared", "online@router", "router", "idle",
                            "online#2", "online@gate", "gate"],
                   help="online#2: the baseline again at the end (its spread is the run's noise)")
    p.add_argument("--engine-cpu", type=int, default=0,
                   help="the core kept for vLLM's engine process (see engine_isolated); -1: no isolation")
    p.add_argument("--online-reserve", default="0",
                   help="the +reserve scenarios' online reserve: slots, or 'all' for the server's middleware "
                   "(the router takes a number)")
    p.add_argument("--online-quiet-s", type=float, default=1.0, help="the +reserve scenarios' quiet time")
    p.add_argument("--trace", choices=("bursts", "poisson"), default="bursts",
                   help="poisson: online arrivals at exponential gaps of mean --idle-gap-s, open loop, for "
                   "the trace's whole length (no burst or idle phases: the whole-trace figures are the ones)")
    p.add_argument("--model", type=Path, default=MODEL, help="the model directory (make_model.py's)")
    p.add_argument("--plot", type=Path, default=None, help="write the timeline PNG here")
    p.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    trace = phases(args.cycles, args.burst_s, args.idle_s, args.trace == "poisson")
    rows = {r["name"]: summarize(r, trace) for r in results}
    print("\nscenario         burst p50/p99 ms  idle p50/p99 ms  whole p50/p99 ms  TPOT p50/p99 ms  "
          "batch per idle phase   idle rate  total")
    for name, row in rows.items():
        print(f"{name:<16} {row['burst_ttft_p50_ms']!s:>6} / {row['burst_ttft_p99_ms']!s:<7} "
              f"{row['idle_ttft_p50_ms']!s:>6} / {row['idle_ttft_p99_ms']!s:<7} "
              f"{row['ttft_p50_ms']!s:>6} / {row['ttft_p99_ms']!s:<7} "
              f"{row['tpot_p50_ms']!s:>6} / {row['tpot_p99_ms']!s:<7} "
              f"{str(row['batch_per_idle_phase']):<22} {row['batch_idle_rate']!s:>8} {row['batch_total']:>6}")
    for line in ratios(rows):
        print(line)
    if args.plot:
        plot(results, trace, args.plot)
        print(f"timeline: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "results": results}))


if __name__ == "__main__":
    main()
