"""LoRA batches: the same requests on the base model, over 4 adapters grouped, and interleaved.

One vLLM CPU server (the tiny generated model, ``--enable-lora --max-lora-rank 8``) with four
adapters from ``inference_images/vllm/make_lora.py`` preloaded, ``--max-loras`` slots for them in
a step (default 1: fewer slots than adapters, the multi-tenant case). The batch's own driver
(``driver.runner.run_shard``) sends, at ``--concurrency``:

  base         every request on the base model, split into shards of the same size (input
               order), shards one after the other;
  grouped      the same prompts spread over the 4 adapters, in the order this project's split
               writes them (``validate_batch`` + ``split_batch`` with the adapter registry:
               each adapter's requests in shards of their own, shards one after the other, as
               ``airflow dags test`` runs them);
  interleaved  the same file sent in input order, adapters round-robin (what a batch gets
               without grouping);
  one-adapter  every request on a1, shards as for base: what vLLM's LoRA path costs by itself,
               the floor for grouped.

Same prompts and max_tokens everywhere (``ignore_eos``: every request generates exactly
``--max-tokens``). Rounds alternate the three; the medians and their ratios are printed.

    .venv/bin/python bench/lora_batches.py                 # 256 requests, 3 rounds
    .venv/bin/python bench/lora_batches.py --max-loras 4   # a slot for every adapter

Targets (issue 23): grouped within 15 % of base; grouped >= 1.3x faster than interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from aibrix_operators.batch.job import prefix_order_uri, split_batch, validate_batch
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.localenv import REPO_ROOT, WORK_DIR
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec
from aibrix_operators.storage import LocalStorage

MODEL = WORK_DIR / "models" / "tiny-llama"
SERVED = "tiny-llama"
ADAPTERS = ("a1", "a2", "a3", "a4")
INFERENCE_PYTHON = REPO_ROOT / ".venv-inference" / "bin" / "python"


def make_adapters(root: Path) -> dict[str, Path]:
    made = {}
    for seed, name in enumerate(ADAPTERS, start=1):
        out = root / name
        if not (out / "adapter_config.json").exists():
            subprocess.run([str(INFERENCE_PYTHON), str(REPO_ROOT / "inference_images/vllm/make_lora.py"),
                            str(MODEL), str(out), "--seed", str(seed)], check=True)
        made[name] = out
    return made


def line(cid: str, model: str, k: int, max_tokens: int) -> str:
    text = f"Request {k}: " + " ".join(f"word{(k * 7 + j) % 97}" for j in range(40))
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "messages": [{"role": "user", "content": text}]}}) + "\n"


def write_inputs(root: Path, n: int, max_tokens: int) -> tuple[Path, Path, Path]:
    base = root / "base.jsonl"
    base.write_text("".join(line(f"r{k}", SERVED, k, max_tokens) for k in range(n)))
    mixed = root / "interleaved.jsonl"
    mixed.write_text("".join(line(f"r{k}", ADAPTERS[k % len(ADAPTERS)], k, max_tokens) for k in range(n)))
    one = root / "one-adapter.jsonl"
    one.write_text("".join(line(f"r{k}", ADAPTERS[0], k, max_tokens) for k in range(n)))
    return base, mixed, one


def split_shards(root: Path, source: Path, per_shard: int) -> list[str]:
    """The shard files this project's validate + split write for ``source``."""
    storage = LocalStorage()
    work = root / f"split-{source.stem}"
    shutil.rmtree(work, ignore_errors=True)
    report, batch = validate_batch(storage, str(source), str(root / "out"), prefix_grouping="auto",
                                   prefix_order_uri=prefix_order_uri(str(work)),
                                   adapters={a: SERVED for a in ADAPTERS})
    assert batch is not None, report.summary()
    return [s.uri for s in split_batch(storage, batch, str(work), per_shard, 1 << 30, 1024)]


async def send(files: list[str], endpoint: str, concurrency: int, results: Path) -> float:
    shutil.rmtree(results, ignore_errors=True)
    config = DriverConfig(endpoint=endpoint, concurrency=concurrency, api_key_env=None,
                          progress_interval_s=3600)
    storage = LocalStorage()
    started = time.perf_counter()
    for k, uri in enumerate(files):
        outcome = await run_shard(storage, uri, str(results / f"s{k}"), config)
        assert outcome.failed == 0, outcome
    return time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--per-shard", type=int, default=64)
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    root = WORK_DIR / "bench" / "lora-batches"
    root.mkdir(parents=True, exist_ok=True)
    folders = make_adapters(root / "adapters")
    base, mixed, one = write_inputs(root, args.requests, args.max_tokens)
    grouped = split_shards(root, mixed, args.per_shard)
    base_shards = split_shards(root, base, args.per_shard)
    one_shards = split_shards(root, one, args.per_shard)
    spec = VLLMServerSpec(
        model=str(MODEL), served_model_name=SERVED, max_model_len=1024,
        extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(args.max_loras),
                    "--max-cpu-loras", str(len(ADAPTERS)), "--max-num-seqs", str(args.concurrency),
                    "--lora-modules", *[f"{n}={p}" for n, p in folders.items()]],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
    )
    paths = {"base": base_shards, "grouped": grouped, "interleaved": [str(mixed)], "one-adapter": one_shards}
    times: dict[str, list[float]] = {name: [] for name in paths}
    print(f"{args.requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"{len(ADAPTERS)} adapters, --max-loras {args.max_loras}; shards of {args.per_shard}: base "
          f"{len(base_shards)}, grouped {len(grouped)}; interleaved: one file")
    with VLLMServer(spec) as server:
        # One uncounted round first: the first requests of each adapter after a start are slower.
        for r in range(-1, args.rounds):
            for name, files in paths.items():
                seconds = asyncio.run(send(files, server.base_url, args.concurrency, root / "results"))
                if r >= 0:
                    times[name].append(seconds)
                label = r + 1 if r >= 0 else "warm-up"
                print(f"round {label} {name:12s} {seconds:7.2f} s  {args.requests / seconds:6.1f} req/s",
                      flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    print("\nmedian seconds: " + ", ".join(f"{n} {s:.2f}" for n, s in med.items()))
    over = med["grouped"] / med["base"] - 1
    speedup = med["interleaved"] / med["grouped"]
    print(f"grouped vs base: {over:+.1%} (target within +15%): {'met' if over <= 0.15 else 'NOT met'}")
    print(f"grouped vs interleaved: {speedup:.2f}x faster (target >= 1.3x): "
          f"{'met' if speedup >= 1.3 else 'NOT met'}")
    print(f"one adapter vs base: {med['one-adapter'] / med['base'] - 1:+.1%} (vLLM's LoRA path alone); "
          f"grouped vs one adapter: {med['grouped'] / med['one-adapter'] - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
