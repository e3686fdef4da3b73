"""Lookahead prefetch (``lookahead_requests``): TTFT of queued L2-hit requests, off vs on.

Two measuring vLLM CPU servers with the connector, identical but for ``lookahead_requests``
(0 and ``--lookahead``), both ``kv_consumer`` (they load, never store, so neither fills L2 for
the other) and ``--max-num-seqs 1`` (one request runs, the rest wait: the queue depth is the
number sent at once). A third server (``kv_both``) produces each round's prompts into Redis
beforehand. Every round:

* ``l2_hits``: ``--depth`` new prompts, produced into Redis, sent at once to each measuring
  server in turn (the order alternates by round). Neither server has them in L1, so without
  the lookahead every request reads Redis when it is scheduled; with it, the waiting ones are
  fetched into L1 while earlier ones compute.
* ``no_hits``: ``--depth`` prompts that are nowhere (the lookahead's cost when it finds nothing).

TTFT is the time to the first streamed chunk, queue wait included (what a client sees). The
comparison is the median of paired ratios (same round, same position in the queue) with a
bootstrap 90 % interval, beside the plain medians. Issue 23's targets: ``l2_hits`` on/off
<= 0.80 (TTFT >= 20 % lower) and ``no_hits`` on/off <= 1.03. The connector's counters say
where each loaded request's KV was when it was scheduled (``kvcache_load_requests_total``).

    .venv-inference/bin/python bench/kvcache_lookahead.py [--model .work/models/bench-llama]
        [--depth 8] [--rounds 5] [--prompt-tokens 1024] [--max-tokens 16] [--lookahead 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.launch import REPO, LocalServer, free_port, kv_transfer_config  # noqa: E402


def stream_ttft(server: LocalServer, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending to the first streamed chunk; the rest of the answer is read."""
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    first = None
    while True:
        line = resp.readline()
        if not line:
            break
        if first is None and line.startswith(b"data:"):
            first = time.perf_counter() - t0
    conn.close()
    assert first is not None
    return first


def queue_ttfts(server: LocalServer, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """All sent at once (submitted in order, 20 ms apart, so the queue order is the list's)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for p in prompts:
            futures.append(pool.submit(stream_ttft, server, p, max_tokens))
            time.sleep(0.02)
        return [f.result() for f in futures]


def metric(port: int, name: str) -> float:
    with __import__("urllib.request").request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def paired(on: list[float], off: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median of the paired ratios on/off and its bootstrap 90 % interval."""
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), boots[100], boots[1899]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".work/models/bench-llama"))
    ap.add_argument("--depth", type=int, default=8, help="requests sent at once (the queue depth)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lookahead", type=int, default=4, help="lookahead_requests of the 'on' server")
    ap.add_argument("--l1-bytes", type=int, default=1 << 30)
    ap.add_argument("--bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND for every server")
    ap.add_argument("--settle", type=float, default=1.5, help="seconds between two servers' queues")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    rng = random.Random(11)

    def new_prompts() -> list[list[int]]:
        return [[rng.randrange(100, 2000) for _ in range(args.prompt_tokens)] for _ in range(args.depth)]

    redis_port = free_port()
    ports = {"producer": free_port(), "off": free_port(), "on": free_port()}
    with ExitStack() as stack:
        redis = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
                                  "--bind", "127.0.0.1", "--save", ""], stdout=subprocess.DEVNULL)
        stack.callback(redis.terminate)
        base = {"l2_backend": "redis", "l2_redis_url": f"redis://127.0.0.1:{redis_port}/0",
                "l1_capacity_bytes": args.l1_bytes, "l2_redis_timeout_s": 2.0}
        servers: dict[str, LocalServer] = {}
        for name, role, lookahead in (("producer", "kv_both", 0), ("off", "kv_consumer", 0),
                                      ("on", "kv_consumer", args.lookahead)):
            extra = {**base, "metrics_port": ports[name], "lookahead_requests": lookahead}
            servers[name] = stack.enter_context(LocalServer(
                args.model, kv_config=kv_transfer_config(extra, role=role), threads_bind=args.bind,
                extra_args=["--max-num-seqs", "1"]))
            print(f"{name} server up", flush=True)
        ttft: dict[str, dict[str, list[float]]] = {w: {"off": [], "on": []} for w in ("l2_hits", "no_hits")}
        for r in range(args.rounds):
            hits = new_prompts()
            for p in hits:  # into Redis (written behind: wait until the producer's queue is drained)
                servers["producer"].complete(p, max_tokens=1, logprobs=None)
            time.sleep(2.0)
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for workload, prompts in (("l2_hits", hits), ("no_hits", new_prompts())):
                for name in order:
                    time.sleep(args.settle)
                    ttft[workload][name] += queue_ttfts(servers[name], prompts, args.max_tokens)
            print(f"round {r + 1}: " + ", ".join(
                f"{w} {n} {statistics.median(ttft[w][n][-args.depth:]) * 1000:.0f} ms"
                for w in ttft for n in ("off", "on")), flush=True)
        sources = {n: {s: metric(ports[n], f'kvcache_load_requests_total{{source="{s}"}}')
                       for s in ("l1", "l2")} for n in ("off", "on")}
        chunks = {o: metric(ports["on"], f'kvcache_lookahead_chunks_total{{outcome="{o}"}}')
                  for o in ("stored", "absent", "failed", "no_slot", "skipped")}
    print(f"\nqueue depth {args.depth}, {args.rounds} rounds, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} tokens out, lookahead_requests={args.lookahead}, model {Path(args.model).name}")
    result: dict[str, Any] = {"sources": sources, "lookahead_chunks": chunks}
    for workload, target in (("l2_hits", 0.80), ("no_hits", 1.03)):
        off, on = ttft[workload]["off"], ttft[workload]["on"]
        ratio, lo, hi = paired(on, off)
        result[workload] = {"off_ms": statistics.median(off) * 1000, "on_ms": statistics.median(on) * 1000,
                            "ratio": ratio, "ci90": [lo, hi]}
        print(f"{workload}: TTFT median off {statistics.median(off) * 1000:.0f} ms, on "
              f"{statistics.median(on) * 1000:.0f} ms; paired on/off {ratio:.3f} (90% CI {lo:.3f}-{hi:.3f}); "
              f"target <= {target:.2f}: {'met' if hi <= target else 'not met'}")
    print(f"requests loaded with all their KV in L1 / some from L2: off {sources['off']['l1']:.0f} / "
          f"{sources['off']['l2']:.0f}, on {sources['on']['l1']:.0f} / {sources['on']['l2']:.0f}")
    print("lookahead chunks: " + ", ".join(f"{k} {v:.0f}" for k, v in chunks.items()))
    if args.json:
        args.json.write_text(json.dumps({**result, "ttft": ttft}))


if __name__ == "__main__":
    main()
