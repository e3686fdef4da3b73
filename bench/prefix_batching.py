"""Prefix-aware batching: the batch_inference DAG with prefix grouping vs off vs vLLM's `run_batch`.

Workloads (generated, chat, ``max_tokens`` 16):
  shared   ``--prefixes`` few-shot templates of ~``--prefix-tokens`` tokens each, one question
           per request, questions shuffled across the file (a nightly eval's shape); the
           templates' total KV is several times the server's KV cache (printed).
  unique   prompts with no shared prefix (the e2e bench's generator): grouping's cost.

Every path starts the same engine (same model, same engine arguments, KV cache of
``--kv-cache-mib``, vLLM's prefix caching on, ``VLLM_CPU_OMP_THREADS_BIND=0``), exactly as
``bench/e2e_vs_run_batch.py`` runs and times them (its functions are reused): from launch until
the results are on disk and the processes have exited. Rounds alternate the paths.

    .venv/bin/python bench/prefix_batching.py --requests 5000 [--trigger dags-test]
    .venv/bin/python bench/prefix_batching.py --requests 1000 --prefixes 12 --skip-unique  # quick

Targets (issue 12): shared, DAG grouping / run_batch >= 1.5x throughput; unique, grouping
costs <= 3% (DAG auto vs off).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_vs_run_batch import (  # noqa: E402 - the bench directory is not a package
    add_stack_args,
    bench_env,
    count_lines,
    dag_submitter,
    run_baseline,
    run_dag,
    write_input,
)

from aibrix_operators.localenv import WORK_DIR  # noqa: E402
from aibrix_operators.serving.local_vllm import VLLMServerSpec  # noqa: E402

MAX_MODEL_LEN = 4096
_WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
          "forest ember harbor lantern meadow quartz").split()


def write_shared(path: Path, n: int, prefixes: int, prefix_words: int, model: str, max_tokens: int,
                 seed: int = 0) -> None:
    rng = random.Random(seed)
    templates = []
    for g in range(prefixes):
        shots = [f"Example {g}.{k}: " + " ".join(rng.choice(_WORDS) for _ in range(24)) +
                 f" Answer: {rng.choice('ABCD')}" for k in range(max(1, prefix_words // 24))]
        templates.append(f"Subject {g}. Answer with one letter.\n" + "\n".join(shots))
    rows = [i % prefixes for i in range(n)]
    rng.shuffle(rows)
    with open(path, "w") as fh:
        for i, g in enumerate(rows):
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                    "messages": [{"role": "system", "content": templates[g]},
                                 {"role": "user", "content": f"Question {i}: which option fits "
                                  f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}?"}]}
            fh.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}) + "\n")


def kv_bytes_per_token(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * 4  # K and V, float32


def dag_stats(out: Path) -> dict:
    batch = json.loads((out / "batch.json").read_text())
    prompt = cached = n = 0
    with open(out / "output.jsonl") as fh:
        for line in fh:
            usage = json.loads(line)["response"]["body"]["usage"]
            prompt += usage["prompt_tokens"]
            cached += ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            n += 1
    return {"completed": batch["request_counts"]["completed"], "prompt_tokens": prompt,
            "cached_tokens": cached, "answered": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--prefixes", type=int, default=40, help="distinct few-shot templates")
    p.add_argument("--prefix-words", type=int, default=240, help="words per template (~5 tokens each)")
    p.add_argument("--kv-cache-mib", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    add_stack_args(p, 1, "alternating rounds of every path")
    p.add_argument("--skip-unique", action="store_true", help="only the shared-prefix workload")
    p.add_argument("--skip-shared", action="store_true", help="only the no-shared-prefix workload")
    args = p.parse_args()

    bench_dir = WORK_DIR / "bench" / "prefix"
    bench_dir.mkdir(parents=True, exist_ok=True)
    kv_bytes = args.kv_cache_mib << 20
    engine_args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                   "--kv-cache-memory-bytes", str(kv_bytes), "--enforce-eager",
                   "--enable-prompt-tokens-details"]
    spec = lambda: VLLMServerSpec(  # noqa: E731 - a fresh spec per run (it records its port)
        model=args.model, served_model_name=args.served_model_name, max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=kv_bytes, extra_args=["--enable-prompt-tokens-details"])
    shared_in = bench_dir / f"shared-{args.requests}x{args.prefixes}x{args.prefix_words}.jsonl"
    write_shared(shared_in, args.requests, args.prefixes, args.prefix_words, args.served_model_name,
                 args.max_tokens)
    unique_in = bench_dir / f"unique-{args.requests}.jsonl"
    write_input(unique_in, args.requests, args.served_model_name, args.max_tokens)

    env = bench_env(bench_dir, args.trigger)
    submit, deployment = dag_submitter(args.trigger, env)

    paths: list[tuple[str, str, Path, str | None]] = []  # (label, workload, input, grouping|None)
    if not args.skip_shared:
        paths += [("shared: run_batch", "shared", shared_in, None),
                  ("shared: DAG, grouping auto", "shared", shared_in, "auto"),
                  ("shared: DAG, grouping off", "shared", shared_in, "off")]
    if not args.skip_unique:
        paths += [("unique: DAG, grouping auto", "unique", unique_in, "auto"),
                  ("unique: DAG, grouping off", "unique", unique_in, "off")]
    times: dict[str, list[float]] = {label: [] for label, *_ in paths}
    answered: dict[str, int] = {}
    stats: dict[str, dict] = {}
    try:
        for round_no in range(1, args.repeats + 1):
            for label, _, input_path, grouping in paths:
                tag = label.replace(": ", "-").replace(", ", "-").replace(" ", "_")
                if grouping is None:
                    out = bench_dir / f"{tag}-{round_no}.jsonl"
                    times[label].append(run_baseline(args.model, args.served_model_name, input_path,
                                                     out, env, engine_args))
                    answered[label] = count_lines(out)
                else:
                    out = bench_dir / f"{tag}-{round_no}"
                    times[label].append(run_dag(args.model, args.served_model_name, input_path, out,
                                                submit, spec(), {"prefix_grouping": grouping}))
                    stats[label] = dag_stats(out)
                    answered[label] = stats[label]["completed"]
                print(f"round {round_no}: {label}: {times[label][-1]:.1f} s, "
                      f"{answered[label]} answered", flush=True)
    finally:
        if deployment is not None:
            deployment.stop()

    per_token = kv_bytes_per_token(args.model)
    cache_tokens = kv_bytes // per_token
    print(f"\n{args.requests} requests per workload, max_tokens={args.max_tokens}, model {args.model}, "
          f"KV cache {args.kv_cache_mib} MiB = {cache_tokens:,} tokens, median of {args.repeats} "
          f"round(s), DAG via {args.trigger}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"load average {os.getloadavg()[0]:.1f}")
    g = stats.get("shared: DAG, grouping auto")
    if g:
        per_req = g["prompt_tokens"] / max(1, g["answered"])
        print(f"shared workload: {args.prefixes} templates, {per_req:,.0f} prompt tokens per request; "
              f"templates' KV ~ {args.prefixes * per_req:,.0f} tokens = "
              f"{args.prefixes * per_req / cache_tokens:.1f}x the KV cache")
    print(f"{'path':<32}{'seconds':>9}{'answered':>10}{'req/s':>9}{'cached prompt tokens':>24}")
    rate: dict[str, float] = {}
    for label, *_ in paths:
        secs = statistics.median(times[label])
        rate[label] = answered[label] / secs
        s = stats.get(label)
        cached = f"{s['cached_tokens']:,} / {s['prompt_tokens']:,}" if s else "-"
        print(f"{label:<32}{secs:>9.1f}{answered[label]:>10}{rate[label]:>9.1f}{cached:>24}")
    ok = True
    if not args.skip_shared:
        vs_rb = rate["shared: DAG, grouping auto"] / rate["shared: run_batch"]
        vs_off = rate["shared: DAG, grouping auto"] / rate["shared: DAG, grouping off"]
        print(f"shared: DAG grouping / run_batch = {vs_rb:.2f}x (target >= 1.5x); "
              f"grouping / off = {vs_off:.2f}x")
        ok &= vs_rb >= 1.5
    if not args.skip_unique:
        cost = 1 - rate["unique: DAG, grouping auto"] / rate["unique: DAG, grouping off"]
        print(f"unique: grouping costs {100 * cost:+.1f}% throughput (target <= 3%)")
        ok &= cost <= 0.03
    return 0 if ok and all(n == args.requests for n in answered.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
