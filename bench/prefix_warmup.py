"""The driver's prefix warm-up (driver/warmup.py) on and off, on one real vLLM CPU server.

A grouped shard as the prefix-grouped split writes it (``--groups`` few-shot templates of
~``--prefix-words`` words, ``--members`` questions each, each group back to back, a ``.lines``
file next to it) is sent by ``run_shard`` with ``warm_up`` on and off, alternating, on the
same server (prefix caching on, ``--enable-prompt-tokens-details``). Every run gets templates
of its own (a different seed, same sizes), so no run finds another run's prefixes cached.
Reported: wall time of ``run_shard`` and the cached prompt tokens the server reports.

    flock /tmp/vllm.lock .venv/bin/python bench/prefix_warmup.py            # ~3 min
    flock /tmp/vllm.lock .venv/bin/python bench/prefix_warmup.py --groups 8 --members 8 --rounds 1  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

from aibrix_operators.batch.shard_results import shard_result_log
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.localenv import WORK_DIR
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec
from aibrix_operators.storage import LocalStorage

_WORDS = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
    "forest ember harbor lantern meadow quartz"
).split()


def write_grouped_shard(
    directory: Path, groups: int, members: int, words: int, model: str, max_tokens: int, seed: int
) -> str:
    rng = random.Random(seed)
    lines = []
    for g in range(groups):
        template = f"Run {seed}, subject {g}. Answer with one letter.\n" + "\n".join(
            f"Example {g}.{k}: "
            + " ".join(rng.choice(_WORDS) for _ in range(24))
            + f" Answer: {rng.choice('ABCD')}"
            for k in range(max(1, words // 24))
        )
        for m in range(members):
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "messages": [
                    {"role": "system", "content": template},
                    {"role": "user", "content": f"Question {m}: {rng.choice(_WORDS)}?"},
                ],
            }
            lines.append(
                json.dumps(
                    {"custom_id": f"g{g}-m{m}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
            )
    directory.mkdir(parents=True, exist_ok=True)
    shard = directory / "shard-00000.jsonl"
    shard.write_text("\n".join(lines) + "\n")
    (directory / "shard-00000.lines").write_bytes(array("q", range(1, len(lines) + 1)).tobytes())
    return str(shard)


async def one_run(
    endpoint: str, shard: str, results: str, concurrency: int, warm_up: bool, wait_s: float
) -> tuple[float, int, int]:
    config = DriverConfig(
        endpoint=endpoint, concurrency=concurrency, api_key_env=None, progress_interval_s=600
    )
    t0 = time.monotonic()
    outcome = await run_shard(LocalStorage(), shard, results, config, warm_up=warm_up, warmup_wait_s=wait_s)
    elapsed = time.monotonic() - t0
    assert outcome.completed == outcome.total, outcome
    cached = prompt = 0
    for _, line in shard_result_log(LocalStorage(), results, shard).iter_records():
        usage = json.loads(line)["response"]["body"]["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return elapsed, cached, prompt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--prefix-words", type=int, default=240, help="words per template (~5 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--kv-cache-mib", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of off and on")
    p.add_argument(
        "--wait-s", type=float, default=5.0, help="the warm-up's bound (run_shard's warmup_wait_s)"
    )
    p.add_argument("--model", default=str(WORK_DIR / "models" / "tiny-llama"))
    args = p.parse_args(argv)
    spec = VLLMServerSpec(
        model=args.model,
        served_model_name="tiny-llama",
        max_model_len=4096,
        kv_cache_bytes=args.kv_cache_mib << 20,
        extra_args=["--enable-prompt-tokens-details", "--enable-prefix-caching"],
        env={"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")},
    )
    rows: dict[str, list[tuple[float, int, int]]] = {"warm-up off": [], "warm-up on": []}
    with tempfile.TemporaryDirectory(prefix="warmup-bench-") as tmp, VLLMServer(spec) as server:
        seed = 0
        for r in range(args.rounds):
            for label in rows:
                seed += 1
                d = Path(tmp) / f"run-{seed}"
                shard = write_grouped_shard(
                    d, args.groups, args.members, args.prefix_words, "tiny-llama", args.max_tokens, seed
                )
                res = asyncio.run(
                    one_run(
                        server.base_url,
                        shard,
                        str(d / "results"),
                        args.concurrency,
                        label == "warm-up on",
                        args.wait_s,
                    )
                )
                rows[label].append(res)
                print(
                    f"round {r + 1}: {label}: {res[0]:.1f} s, cached {res[1]:,} of {res[2]:,} prompt tokens",
                    flush=True,
                )
    n = args.groups * args.members
    print(
        f"\n{n} requests ({args.groups} groups x {args.members}), concurrency {args.concurrency}, "
        f"warm-up bound {args.wait_s} s, "
        f"max_tokens {args.max_tokens}, KV cache {args.kv_cache_mib} MiB, median of {args.rounds} "
        f"round(s), load average {os.getloadavg()[0]:.1f}"
    )
    med = {}
    for label, runs in rows.items():
        secs = statistics.median(x[0] for x in runs)
        cached = statistics.median(x[1] for x in runs)
        med[label] = secs
        print(
            f"{label:<14} {secs:7.1f} s  {n / secs:7.1f} req/s  cached prompt tokens {cached:,.0f} of "
            f"{runs[0][2]:,}"
        )
    print(f"warm-up on / off throughput: {med['warm-up off'] / med['warm-up on']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
