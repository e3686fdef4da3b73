"""What the P/D router adds per request, against zero-latency prefill and decode stubs.

Three processes: the stubs (``tests/fake_openai.py``, one prefill and one decode instance) and
this load generator share CPU 1; the router (``python -m aibrix_operators.router``) has
CPU 0 to itself: "one router core". Each router request is two stub calls (prefill with
max_tokens=1, then decode), so the baseline makes the same two calls directly, in the
same run, with the same raw keep-alive client.

- **throughput**: closed loop, 64 requests in flight, requests/s (target >= 1,500).
- **added latency**: 64 connections paced at ``--rate`` req/s in total (below saturation,
  so the figure is the router's work and not queueing behind 63 other requests, which a
  closed loop at saturation measures: 64 / throughput), latency from each request's
  scheduled send time (no coordinated omission); router minus direct at the median and
  p99 (targets <= 2 ms / <= 5 ms). The closed-loop latencies are printed too.

- **prefix affinity** (``--affinity-ab``): a second router with ``--prefix-affinity off`` in
  the same run, both in front of two prefill and two decode stubs, requests shaped like an
  eval batch (``--prompt-bytes`` of few-shot template, one of ``--templates``, then a
  question); paced rounds alternate direct, affinity off, affinity on, and the cost of
  affinity is on minus off at the median and p99 (the targets above apply to "on" minus direct).

    .venv/bin/python bench/router_overhead.py                 # full run (~30 s)
    .venv/bin/python bench/router_overhead.py --requests 2000 --seconds 2 --no-pin   # smoke
    .venv/bin/python bench/router_overhead.py --affinity-ab --prompt-bytes 4096      # affinity cost
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from aibrix_operators.serving.local_vllm import free_port
from aibrix_operators.serving.process import stop_process

REPO = Path(__file__).resolve().parent.parent
BODY = b'{"model":"tiny-llama","prompt":"Say something about routers and caches.","max_tokens":16}'


def _request(body: bytes = BODY, path: bytes = b"/v1/completions") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


REQS = [_request()]


def eval_requests(prompt_bytes: int, templates: int, questions: int = 16) -> list[bytes]:
    """Eval-shaped requests: ``templates`` few-shot prefixes of ``prompt_bytes``, each with
    ``questions`` different questions, interleaved (a shuffled file's order)."""
    import json

    examples = range(prompt_bytes // 16 + 1)
    heads = [(f"Template {t}. " + "".join(f"Example {t}.{i}: {i} + {t} = {i + t}. " for i in examples))
             [:prompt_bytes] for t in range(templates)]  # fmt: skip
    return [
        _request(json.dumps({"model": "tiny-llama", "max_tokens": 16,
                             "prompt": heads[t] + f"\nQuestion {q}: what is {q} + {t}?"}).encode())
        for q in range(questions) for t in range(templates)
    ]  # fmt: skip


async def _call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> None:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {head[:60]!r}")
    i = head.lower().find(b"content-length:")
    j = head.find(b"\r\n", i)
    await reader.readexactly(int(head[i + 15 : j]))


@dataclass
class Result:
    rps: float
    latencies: list[float]

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


async def _open(ports: list[int]) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    return [await asyncio.open_connection("127.0.0.1", p) for p in ports]


async def run(ports: list[int], requests: int, concurrency: int, rate: float | None) -> Result:
    """Each request calls every port in ``ports`` in turn (direct: prefill, decode; router: one)."""
    conns = [await _open(ports) for _ in range(concurrency)]
    lat: list[float] = []
    per_worker = requests // concurrency
    interval = concurrency / rate if rate else 0.0
    t_start = time.perf_counter() + 0.05

    async def worker(k: int) -> None:
        streams = conns[k]
        for n in range(per_worker):
            if rate:
                scheduled = t_start + (n + k / concurrency) * interval
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                scheduled = time.perf_counter()
            req = REQS[(k * per_worker + n) % len(REQS)]
            for reader, writer in streams:
                await _call(reader, writer, req)
            lat.append(time.perf_counter() - scheduled)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for streams in conns:
        for _, writer in streams:
            writer.close()
    return Result(rps=len(lat) / elapsed, latencies=lat)


class Proc:
    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)

    def line(self, prefix: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.proc.args} exited ({self.proc.poll()})")
            if line.startswith(prefix):
                return line
        raise TimeoutError(prefix)

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10)


def _wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used: what the router costs per request,
    whatever else this shared machine runs on its core meanwhile."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    global REQS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=30_000, help="requests per closed-loop run")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rate", type=float, default=1000.0, help="paced runs: requests/s in total")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each paced run")
    p.add_argument("--rounds", type=int, default=3, help="paced rounds (each: direct, then router)")
    p.add_argument("--no-pin", action="store_true", help="don't pin processes to CPUs (smoke tests)")
    p.add_argument(
        "--affinity-ab",
        action="store_true",
        help="two routers, --prefix-affinity off and on, two instances per role",
    )
    p.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="eval-shaped prompts with a shared template of this many bytes (0: one short prompt)",
    )
    p.add_argument("--templates", type=int, default=64, help="distinct templates with --prompt-bytes")
    args = p.parse_args(argv)
    if args.prompt_bytes:
        REQS = eval_requests(args.prompt_bytes, args.templates)
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    cpu_router, cpu_rest = (["--cpu", "0"], ["--cpu", "1"]) if pin else ([], [])
    if pin:
        os.sched_setaffinity(0, {1})
    stubs = Proc([sys.executable, str(REPO / "tests/fake_openai.py"), "--count", "4", *cpu_rest])
    variants = [("affinity off", "off"), ("affinity on", "on")] if args.affinity_ab else [("router", "on")]
    routers: list[tuple[str, Proc, int]] = []
    try:
        ports = [int(x) for x in stubs.line("PORT").split()[1:]]
        prefill_port, decode_port = ports[0], ports[1]
        instances = ports if args.affinity_ab else ports[:2]
        for name, affinity in variants:
            router_port = free_port()
            env_cmd = [sys.executable, "-m", "aibrix_operators.router", "--host", "127.0.0.1",
                       "--port", str(router_port), "--prefix-affinity", affinity, *cpu_router]  # fmt: skip
            for k, port in enumerate(instances):
                env_cmd += ["--prefill" if k % 2 == 0 else "--decode", f"http://127.0.0.1:{port}"]
            routers.append((name, Proc(env_cmd), router_port))
            _wait_healthy(f"http://127.0.0.1:{router_port}")
        loop = _loop()
        c, n = args.concurrency, args.requests
        paced_n = int(args.rate * args.seconds)
        for _, _, port in routers:  # warm up every path
            loop.run_until_complete(run([port], min(n, 3000), c, None))
        loop.run_until_complete(run([prefill_port, decode_port], min(n, 3000), c, None))
        direct = loop.run_until_complete(run([prefill_port, decode_port], n, c, None))
        closed: dict[str, tuple[Result, float]] = {}
        for name, proc, port in routers:
            cpu0 = _cpu_seconds(proc.proc.pid)
            res = loop.run_until_complete(run([port], n, c, None))
            closed[name] = (res, _cpu_seconds(proc.proc.pid) - cpu0)
        # Paced rounds alternate direct and routed, so a burst of other load on this shared
        # machine hits one round of each side, not one side; the verdict takes the median round.
        rounds: list[dict[str, Result]] = []
        for _ in range(args.rounds):
            one = {"direct": loop.run_until_complete(run([prefill_port, decode_port], paced_n, c, args.rate))}
            for name, _, port in routers:
                one[name] = loop.run_until_complete(run([port], paced_n, c, args.rate))
            rounds.append(one)
        loop.close()
    finally:
        # Each stop kills after a grace period, so one stuck process never leaks the others.
        for proc in [r[1] for r in routers] + [stubs]:
            proc.stop()

    def row(name: str, r: Result) -> str:
        return (f"{name:<58} {r.rps:>9.0f} req/s  p50 {r.pct(0.5):7.2f} ms  p99 {r.pct(0.99):7.2f} ms"
                f"  ({len(r.latencies)} requests)")  # fmt: skip

    def added(name: str, base: str = "direct") -> tuple[float, float]:
        a50 = statistics.median(r[name].pct(0.5) - r[base].pct(0.5) for r in rounds)
        a99 = statistics.median(r[name].pct(0.99) - r[base].pct(0.99) for r in rounds)
        return a50, a99

    body = f"{len(REQS)} distinct bodies of ~{len(REQS[0])} bytes" if args.prompt_bytes else "one short body"
    print(f"router overhead, {c} concurrent, {body}, "
          f"pinned={'router cpu0, stubs+client cpu1' if pin else 'no'}")  # fmt: skip
    print(row(f"baseline: direct calls (prefill + decode stub), closed loop {c}", direct))
    for name, _, _ in routers:
        print(row(f"{name} (prefill + decode), closed loop {c}", closed[name][0]))
    for i, one in enumerate(rounds):
        print(row(f"baseline: direct calls, paced {args.rate:.0f} req/s, round {i + 1}", one["direct"]))
        for name, _, _ in routers:
            print(row(f"{name}, paced {args.rate:.0f} req/s, round {i + 1}", one[name]))
    for name, _, _ in routers:
        routed, router_cpu = closed[name]
        cpu_rps = len(routed.latencies) / router_cpu if router_cpu > 0 else float("inf")
        print(f"{name} throughput: {routed.rps:.0f} req/s on one core, wall clock (target >= 1500); "
              f"{router_cpu / len(routed.latencies) * 1e3:.3f} ms of router CPU per request = "
              f"{cpu_rps:.0f} req/s per fully available core")  # fmt: skip
        a50, a99 = added(name)
        print(f"{name} added latency at {args.rate:.0f} req/s over {c} connections (median of {len(rounds)} "
              f"rounds): median {a50:.2f} ms (target <= 2), p99 {a99:.2f} ms (target <= 5)")  # fmt: skip
        for i, one in enumerate(rounds):
            r, d = one[name], one["direct"]
            print(f"  round {i + 1}: added median {r.pct(0.5) - d.pct(0.5):.2f} ms, "
                  f"p99 {r.pct(0.99) - d.pct(0.99):.2f} ms")  # fmt: skip
    if args.affinity_ab:
        a50, a99 = added("affinity on", "affinity off")
        cpu_on = closed["affinity on"][1] / len(closed["affinity on"][0].latencies)
        cpu_off = closed["affinity off"][1] / len(closed["affinity off"][0].latencies)
        print(
            f"prefix affinity's own cost (on minus off, median of rounds): median {a50:.2f} ms, "
            f"p99 {a99:.2f} ms; router CPU per request {cpu_on * 1e3:.3f} vs {cpu_off * 1e3:.3f} ms"
        )
    name = routers[-1][0]
    routed = closed[name][0]
    a50, a99 = added(name)
    print(f"(closed-loop medians are queueing: {c} / throughput = {c / routed.rps * 1e3:.1f} ms)")
    ok = routed.rps >= 1500 and a50 <= 2 and a99 <= 5
    print("verdict:", "targets met" if ok else "targets NOT met", f"({name})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
