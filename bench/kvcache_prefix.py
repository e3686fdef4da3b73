"""Repeated-prefix TTFT on vLLM CPU: cold vs vLLM prefix cache vs ExampleConnector vs ours.

All in one run, on the same prompts, with every server's worker pinned to the same CPU
threads (VLLM_CPU_OMP_THREADS_BIND). Time = wall time of a 1-token completion (TTFT).

How the noise of a shared 2-core VM is kept out of the comparison: the speed of the one
pinned core drifts by 20-40% over minutes (other tenants, frequency), which is larger
than the differences being measured. So every condition's server runs at the same time
(idle servers use ~1% CPU), and requests go out one at a time, round-robin over the
servers: the samples of one prompt in one round are seconds apart for every condition.
Between two requests the bench waits ``--settle`` seconds: after a step, a vLLM worker
keeps spinning on its shared-memory queue for 1 s (vLLM's ``SpinCondition``), and a
spinning idle worker pinned to the same core would halve the next server's compute.
A comparison is then the median of the *paired* ratios (same prompt, same round), with
a bootstrap 90% interval over the pairs, next to the plain medians.

Conditions:
  cold             no connector, prefix caching off (every request recomputes)
  prefix_cache     vLLM's own prefix cache, no connector
  example_conn     vLLM's ExampleConnector (safetensors files on disk)
  ours_l1          KVCacheConnector pipelined, L1 hit
  ours_sync_l1     KVCacheConnector in sync mode, L1 hit (pipelined-vs-sync comparison)
  ours_l2_redis    KVCacheConnector pipelined, L1 too small: hit served by Redis
The first send of each prompt to a connector server stores it: that "storing" TTFT is
where layer-wise save shows. With ``--before-module M`` (e.g. ``kvcache_before.connector``,
an older revision importable under another name via PYTHONPATH) the run adds
``before_l1``, ``before_sync_l1`` and ``before_l2_redis``, the same conditions with that
connector (Redis: the same server, database 1). docs/kvcache.md shows how to extract
an older revision under another package name.
``NAME#2`` in ``--only`` adds a second server of condition NAME (an A/A control: how far
apart two servers of the same configuration land; with two or more servers of both
conditions, a "pooled" line compares the means over each condition's servers, so that
one fast or slow server does not decide). Our servers also report the
connector's own load time per hit (``kvcache_load_seconds``, scraped from the worker).

    .venv-inference/bin/python bench/kvcache_prefix.py --model .work/models/bench-llama
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.launch import REPO, LocalServer, cached_tokens, free_port, kv_transfer_config  # noqa: E402

# Bench model: 12 chunks x 4 MiB = 48 MiB per 1,600-token prompt; this L1 holds one prompt,
# so that three other prompts push the measured ones out to Redis.
ONE_PROMPT_L1_BYTES = 64 << 20


def prompts(n: int, length: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 2000) for _ in range(length)] for _ in range(n)]


def ttft(server: LocalServer, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = server.complete(prompt, max_tokens=1, logprobs=None)
    return time.perf_counter() - t0, cached_tokens(r)


def conditions(tmp: Path, redis_url: str, before_module: str) -> dict[str, dict | None]:
    """name -> kv-transfer-config (None: no connector). prefix_cache is the only one with
    vLLM's prefix cache on."""
    conds: dict[str, dict | None] = {
        "cold": None,
        "prefix_cache": None,
        "example_conn": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
        },
        "ours_l1": kv_transfer_config({"l1_capacity_bytes": 2 << 30}),
        "ours_sync_l1": kv_transfer_config({"l1_capacity_bytes": 2 << 30, "mode": "sync"}),
        "ours_l2_redis": kv_transfer_config(
            {"l1_capacity_bytes": ONE_PROMPT_L1_BYTES, "l2_backend": "redis", "l2_redis_url": redis_url}
        ),
    }
    if before_module:
        for name, mode in (("before_l1", "pipelined"), ("before_sync_l1", "sync")):
            kv = kv_transfer_config({"l1_capacity_bytes": 2 << 30, "mode": mode})
            kv["kv_connector_module_path"] = before_module
            conds[name] = kv
        # Same Redis server, another database: the two revisions never read each other's records.
        kv = copy.deepcopy(conds["ours_l2_redis"])
        kv["kv_connector_extra_config"]["l2_redis_url"] = redis_url.rsplit("/", 1)[0] + "/1"
        kv["kv_connector_module_path"] = before_module
        conds["before_l2_redis"] = kv
    return conds


def paired_ratio(num: list[float], den: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median of num[i]/den[i] and a bootstrap 90% interval of that median."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), boots[len(boots) // 20], boots[-len(boots) // 20 - 1]


def run(args: argparse.Namespace, run_idx: int) -> dict:
    """One set of servers: hits round-robin, then misses (fresh prompts) round-robin."""
    ps = prompts(args.prompts, args.tokens)
    evict = prompts(3, args.tokens, seed=99)
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-", dir=REPO / ".work"))
    redis_port = free_port()
    conds = conditions(tmp, f"redis://127.0.0.1:{redis_port}/0", args.before_module)
    only = [c for c in args.only.split(",") if c] or list(conds)
    unknown = sorted({c.split("#")[0] for c in only} - set(conds))
    if unknown:
        raise SystemExit(f"unknown condition(s) {unknown}; known: {sorted(conds)}")
    first: dict[str, list[float]] = {c: [] for c in only}
    hits: dict[str, list[float]] = {c: [] for c in only}
    cached: dict[str, int] = {}
    connector: dict[str, dict[str, float]] = {}
    with ExitStack() as stack:
        redis = subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        stack.callback(redis.wait)
        stack.callback(redis.terminate)
        stack.callback(shutil.rmtree, tmp / "example", True)
        servers: dict[str, LocalServer] = {}
        metrics_ports: dict[str, int] = {}
        for name in only:  # one at a time: a starting server takes every core
            base = name.split("#")[0]
            kv = copy.deepcopy(conds[base])
            if kv is not None and kv["kv_connector"] == "KVCacheConnector":
                metrics_ports[name] = kv["kv_connector_extra_config"]["metrics_port"] = free_port()
            server = LocalServer(
                args.model,
                kv_config=kv,
                prefix_caching=base == "prefix_cache",
                threads_bind=args.bind,
                log_path=tmp / f"{name}.log",
            )
            servers[name] = stack.enter_context(server)
            ttft(server, prompts(1, 64, seed=1)[0])  # warm-up
            print(f"started {name}", flush=True)
        for p in ps:  # first sends: cold, or storing for the caches
            for name, server in servers.items():
                time.sleep(args.settle)
                first[name].append(ttft(server, p)[0])
        for rnd in range(args.rounds):
            for name in ("ours_l2_redis", "before_l2_redis"):
                if name in servers:  # push the prompts out of L1: the hit is Redis's
                    for p in evict:
                        ttft(servers[name], p)
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for p in ps:
                for name in order:
                    if name == "cold" and rnd >= args.cold_rounds:
                        continue
                    time.sleep(args.settle)
                    t, c = ttft(servers[name], p)
                    hits[name].append(t)
                    cached[name] = min(cached.get(name, c), c)
            print(f"run {run_idx + 1}: round {rnd + 1}/{args.rounds} done", flush=True)
        # Misses last, so that they cannot push the measured prompts out of any cache.
        for rnd in range(args.miss_rounds):
            fresh = prompts(1, args.tokens, seed=1000 * (run_idx + 1) + rnd)[0]
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for name in order:
                time.sleep(args.settle)
                first[name].append(ttft(servers[name], fresh)[0])
        for name, port in metrics_ports.items():
            connector[name] = scrape_connector_times(port)
    if "cold" in hits:
        hits["cold"] = first["cold"] + hits["cold"]
    return {"first": first, "hits": hits, "cached": cached, "connector": connector}


def merge_runs(runs: list[dict]) -> dict:
    """Concatenate the runs' samples (pairs stay aligned: every run adds the same number of
    samples per condition); connector times are averaged over runs."""
    out: dict = {"first": {}, "hits": {}, "cached": {}, "connector": {}, "per_run": runs}
    for r in runs:
        for key in ("first", "hits"):
            for name, ts in r[key].items():
                out[key].setdefault(name, []).extend(ts)
        for name, c in r["cached"].items():
            out["cached"][name] = min(out["cached"].get(name, c), c)
    for name in runs[0]["connector"]:
        per = [r["connector"][name] for r in runs]
        out["connector"][name] = {k: statistics.fmean(d[k] for d in per) for k in per[0]}
    return out


def scrape_connector_times(port: int) -> dict[str, float]:
    """The connector's mean compute-thread time per step with loads / with saves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for metric in ("kvcache_load_seconds", "kvcache_save_seconds"):
        total = re.search(rf"^{metric}_sum ([0-9.e+-]+)$", text, re.M)
        count = re.search(rf"^{metric}_count ([0-9.e+-]+)$", text, re.M)
        n = float(count.group(1)) if count else 0.0
        values[metric] = float(total.group(1)) / n if total and n else 0.0
    return values


def report(res: dict, args: argparse.Namespace) -> dict:
    first, hits = res["first"], res["hits"]
    summary: dict = {"conditions": {}, "ratios": {}}
    cold = statistics.median(hits["cold"]) if hits.get("cold") else None
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, {args.runs} run(s) x {args.rounds} rounds, "
          f"model {args.model}, worker bind {args.bind}")  # fmt: skip
    print("hit TTFT median (p25-p75) | miss TTFT (first sends: cold/storing) | connector time per step")
    for name, ts in hits.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        row = {
            "ttft_s": statistics.median(ts),
            "p25_s": q[0],
            "p75_s": q[2],
            "n": len(ts),
            "miss_s": statistics.median(first[name]),
            "cached_tokens": res["cached"].get(name, 0),
        }
        summary["conditions"][name] = row
        line = f"  {name:14} {row['ttft_s']:6.3f} s ({q[0]:.3f}-{q[2]:.3f}, n={len(ts)})"
        if name != "cold":
            line += f" cached {row['cached_tokens']}"
            if cold:
                line += f" {cold / row['ttft_s']:4.1f}x cold"
        line += f" | miss {row['miss_s']:.3f} s (n={len(first[name])})"
        conn = res["connector"].get(name)
        if conn:
            row["connector_load_ms"] = 1000 * conn["kvcache_load_seconds"]
            row["connector_save_ms"] = 1000 * conn["kvcache_save_seconds"]
            line += f" | load {row['connector_load_ms']:.1f} ms, save {row['connector_save_ms']:.1f} ms"
        print(line)

    def compare(label: str, kind: str, num: str, den: str, target: str) -> None:
        """Paired ratio of two conditions' ``kind`` samples ("hits" or "first": misses)."""
        samples = res[kind]
        if num not in samples or den not in samples or len(samples[num]) != len(samples[den]):
            return
        med, lo, hi = paired_ratio(samples[num], samples[den])
        per_run = [paired_ratio(r[kind][num], r[kind][den])[0] for r in res["per_run"]]
        summary["ratios"][label] = {"median": med, "ci90": [lo, hi], "per_run": per_run}
        runs = "  runs: " + " ".join(f"{x:.3f}" for x in per_run) if len(per_run) > 1 else ""
        print(f"  {label:30} {med:.3f} (90% CI {lo:.3f}-{hi:.3f}) {target}{runs}")

    def compare_pooled(label: str, kind: str, num: str, den: str) -> None:
        """With several servers of each condition (NAME, NAME#2, ...): the paired ratio of
        the conditions' means over their servers, so that no one server's speed decides."""
        samples = res[kind]
        nums = [n for n in samples if n.split("#")[0] == num]
        dens = [n for n in samples if n.split("#")[0] == den]
        if len(nums) < 2 or len(dens) < 2 or len({len(samples[n]) for n in nums + dens}) != 1:
            return
        means = [[statistics.fmean(samples[n][i] for n in group) for i in range(len(samples[group[0]]))]
                 for group in (nums, dens)]  # fmt: skip
        med, lo, hi = paired_ratio(means[0], means[1])
        summary["ratios"][label] = {"median": med, "ci90": [lo, hi], "servers": [nums, dens]}
        print(f"  {label:30} {med:.3f} (90% CI {lo:.3f}-{hi:.3f}) {len(nums)} + {len(dens)} servers")

    print("paired ratios (same prompt, same round; bootstrap 90% interval of the median):")
    compare("hit ours_l1 / prefix_cache", "hits", "ours_l1", "prefix_cache", "target <= 1.25")
    compare("hit ours_l1 / example_conn", "hits", "ours_l1", "example_conn", "target < 1")
    compare("hit ours_sync_l1 / example_conn", "hits", "ours_sync_l1", "example_conn", "")
    compare("hit sync / pipelined", "hits", "ours_sync_l1", "ours_l1", ">= 1: pipelined does not lose")
    compare("hit ours_l1 / before_l1", "hits", "ours_l1", "before_l1", "cost of the fixes, L1 hit")
    compare("hit ours_sync_l1 / before_sync_l1", "hits", "ours_sync_l1", "before_sync_l1", "")
    compare("hit ours_l2_redis / before_l2_redis", "hits", "ours_l2_redis", "before_l2_redis",
            "cost of the fixes, Redis hit")  # fmt: skip
    for name in hits:  # A/A controls
        if "#" in name:
            compare(f"hit {name} / {name.split('#')[0]}", "hits", name, name.split("#")[0], "A/A: ~1")
    compare("miss sync / pipelined", "first", "ours_sync_l1", "ours_l1", ">= 1: pipelined does not lose")
    for kind, what in (("hits", "hit"), ("first", "miss")):
        compare_pooled(f"{what} sync / pipelined, pooled", kind, "ours_sync_l1", "ours_l1")
    compare_pooled("hit ours_l1 / prefix_cache, pooled", "hits", "ours_l1", "prefix_cache")
    compare_pooled("hit ours_l1 / example_conn, pooled", "hits", "ours_l1", "example_conn")
    for name in ("example_conn", "ours_l1", "ours_sync_l1", "ours_l2_redis", "before_l1", "before_l2_redis"):
        compare(f"miss {name} / cold", "first", name, "cold", "store overhead")
    compare("miss ours_l1 / before_l1", "first", "ours_l1", "before_l1", "cost of the fixes, storing")
    compare("miss ours_l2_redis / before_l2_redis", "first", "ours_l2_redis", "before_l2_redis",
            "cost of the fixes, storing")  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".work/models/bench-llama"))
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10, help="measured rounds of all prompts on every server")
    ap.add_argument("--cold-rounds", type=int, default=1, help="rounds that also re-send to the cold server")
    ap.add_argument("--miss-rounds", type=int, default=5, help="fresh prompts to every server (misses)")
    ap.add_argument("--runs", type=int, default=1, help="fresh sets of servers; samples are pooled")
    ap.add_argument("--settle", type=float, default=1.5, help="idle seconds before each request (> 1)")
    ap.add_argument("--bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND for every server")
    ap.add_argument("--only", default="", help="comma-separated subset of conditions")
    ap.add_argument("--before-module", default="", help="connector module of an older revision to compare")
    ap.add_argument("--json", default="", help="also write samples and summary to this file")
    args = ap.parse_args(argv)
    res = merge_runs([run(args, i) for i in range(args.runs)])
    summary = report(res, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
