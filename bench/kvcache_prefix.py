"""Repeated-prefix TTFT on vLLM CPU: cold vs vLLM prefix cache vs ExampleConnector vs ours.

All in one run, same prompts, one server at a time, every server pinned to the same CPU
threads (VLLM_CPU_OMP_THREADS_BIND). For each condition: send each prompt once (stores /
warms), then ``--hits`` more rounds of all prompts (the measured hits; the median over
prompts x rounds). Time = wall time of a 1-token completion (TTFT).

Conditions:
  cold             no connector, prefix caching off (first sends)
  prefix_cache     vLLM's own prefix cache, no connector
  example_conn     vLLM's ExampleConnector (safetensors files on disk)
  ours_l1          KVCacheConnector pipelined, L1 hit
  ours_l2_redis    KVCacheConnector pipelined, L1 too small: hit served by Redis
  ours_sync_l1     KVCacheConnector in sync mode, L1 hit (pipelined-vs-sync comparison)
Also the cold (storing) TTFT with each of our modes, which is where layer-wise save shows.
With ``--before-module M`` (e.g. ``kvcache_old.connector``, an older revision of the
package importable under another name via PYTHONPATH) the run adds ``before_l1`` and
``before_sync_l1``: the same two conditions with that connector, for a same-run before/after.

    .venv-inference/bin/python bench/kvcache_prefix.py --model .work/models/bench-llama
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.launch import REPO, LocalServer, cached_tokens, free_port, kv_transfer_config  # noqa: E402


def prompts(n: int, length: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 2000) for _ in range(length)] for _ in range(n)]


def ttft(server: LocalServer, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = server.complete(prompt, max_tokens=1, logprobs=None)
    return time.perf_counter() - t0, cached_tokens(r)


def measure(
    server: LocalServer, ps: list[list[int]], hits: int, evict: list[list[int]] | None = None
) -> dict:
    first = [ttft(server, p) for p in ps]
    second: list[tuple[float, int]] = []
    for _ in range(hits):
        if evict:  # push the prompts out of L1, so that the hit is served by L2
            for p in evict:
                ttft(server, p)
        time.sleep(1.0)  # let write-behind to L2 finish
        second += [ttft(server, p) for p in ps]
    return {
        "first_s": statistics.median(t for t, _ in first),
        "hit_s": statistics.median(t for t, _ in second),
        "hit_spread_s": (min(t for t, _ in second), max(t for t, _ in second)),
        "cached": min(c for _, c in second),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".work/models/bench-llama"))
    ap.add_argument("--tokens", type=int, default=1600)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--hits", type=int, default=5, help="measured rounds of repeats (median over all)")
    ap.add_argument("--bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND for every server")
    ap.add_argument("--only", default="", help="comma-separated subset of conditions")
    ap.add_argument("--before-module", default="", help="connector module of an older revision to compare")
    args = ap.parse_args(argv)
    ps = prompts(args.prompts, args.tokens)
    evict = prompts(3, args.tokens, seed=99)
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-", dir=REPO / ".work"))
    redis_port = free_port()
    redis_proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    one_prompt_bytes = 64 << 20  # bench model: 12 chunks x 4 MiB = 48 MiB per 1600-token prompt
    conds: dict[str, tuple[dict | None, bool, list | None]] = {
        "cold": (None, False, None),
        "prefix_cache": (None, True, None),
        "example_conn": (
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")}},
            False, None,
        ),
        "ours_l1": (kv_transfer_config({"l1_capacity_bytes": 2 << 30}), False, None),
        "ours_l2_redis": (
            kv_transfer_config({"l1_capacity_bytes": one_prompt_bytes, "l2_backend": "redis",
                                "l2_redis_url": redis_url}),
            False, evict,
        ),
        "ours_sync_l1": (kv_transfer_config({"l1_capacity_bytes": 2 << 30, "mode": "sync"}), False, None),
    }  # fmt: skip
    if args.before_module:
        for name, mode in (("before_l1", "pipelined"), ("before_sync_l1", "sync")):
            kv = kv_transfer_config({"l1_capacity_bytes": 2 << 30, "mode": mode})
            kv["kv_connector_module_path"] = args.before_module
            conds[name] = (kv, False, None)
    only = set(filter(None, args.only.split(",")))
    results: dict[str, dict] = {}
    try:
        for name, (kv, prefix, ev) in conds.items():
            if only and name not in only:
                continue
            server = LocalServer(args.model, kv_config=kv, prefix_caching=prefix, max_model_len=4096,
                                 threads_bind=args.bind, log_path=tmp / f"{name}.log")  # fmt: skip
            with server:
                ttft(server, prompts(1, 64, seed=1)[0])  # warm-up
                results[name] = measure(server, ps, args.hits, ev)
            r = results[name]
            lo, hi = r["hit_spread_s"]
            print(f"{name:14} first {r['first_s']:.3f} s   repeat {r['hit_s']:.3f} s "
                  f"(min {lo:.3f}, max {hi:.3f})   cached {r['cached']}", flush=True)  # fmt: skip
    finally:
        redis_proc.terminate()
        redis_proc.wait()
        shutil.rmtree(tmp / "example", ignore_errors=True)
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, {args.hits} hit rounds, model {args.model}, "
          f"bind {args.bind}")  # fmt: skip
    cold = results.get("cold", {}).get("first_s")
    for name, r in results.items():
        t = r["first_s"] if name == "cold" else r["hit_s"]
        line = f"  {name:14} {t:7.3f} s"
        if cold:
            line += f"   {cold / t:6.1f}x faster than cold"
        print(line)
    if "ours_l1" in results:
        ours = results["ours_l1"]["hit_s"]
        if "prefix_cache" in results:
            print(
                f"  ours_l1 / prefix_cache = {ours / results['prefix_cache']['hit_s']:.2f} (target <= 1.25)"
            )
        if "example_conn" in results:
            print(f"  ours_l1 / example_conn = {ours / results['example_conn']['hit_s']:.2f} (target < 1)")
        if "ours_sync_l1" in results:
            s, p = results["ours_sync_l1"], results["ours_l1"]
            print(f"  pipelined vs sync: hit TTFT {s['hit_s'] / p['hit_s']:.2f}x, "
                  f"storing TTFT {s['first_s'] / p['first_s']:.2f}x (>1 = pipelined faster)")  # fmt: skip
    for before, after in (("before_l1", "ours_l1"), ("before_sync_l1", "ours_sync_l1")):
        if before in results and after in results:
            b, a = results[before], results[after]
            print(f"  {after} vs {before}: hit {b['hit_s']:.3f} -> {a['hit_s']:.3f} s, "
                  f"storing {b['first_s']:.3f} -> {a['first_s']:.3f} s")  # fmt: skip
    if "before_l1" in results and "before_sync_l1" in results:
        s, p = results["before_sync_l1"], results["before_l1"]
        print(f"  before: pipelined vs sync: hit TTFT {s['hit_s'] / p['hit_s']:.2f}x, "
              f"storing TTFT {s['first_s'] / p['first_s']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
