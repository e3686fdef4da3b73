"""End-to-end overhead: the batch_inference DAG vs vLLM's own `run_batch`, same input.

Both paths start the same vLLM engine on the same model with the same engine
arguments, answer the same requests, and write OpenAI batch output; each is
timed from launch until its results are on disk and its processes have exited.
The DAG path starts the server and submits the batch at the same moment.

    .venv/bin/python bench/e2e_vs_run_batch.py --requests 5000

Prints both times and the throughput ratio (DAG / run_batch; target ≥ 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from aibrix_operators.localenv import REPO_ROOT, WORK_DIR, airflow_env
from aibrix_operators.serving.local_vllm import DEFAULT_PYTHON, VLLMServer, VLLMServerSpec

ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "4096",
    "--kv-cache-memory-bytes",
    str(512 << 20),
    "--enforce-eager",
]


def write_input(path: Path, n: int, model: str, max_tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "batch shard token cache decode prefill airflow model layer request".split()
    with open(path, "w") as fh:
        for i in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "messages": [{"role": "user", "content": f"{i}: {prompt}"}],
            }
            fh.write(
                json.dumps(
                    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
                + "\n"
            )


def count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def run_baseline(model: str, name: str, input_path: Path, out: Path, env: dict[str, str]) -> float:
    started = time.monotonic()
    subprocess.run(
        [
            str(DEFAULT_PYTHON),
            "-m",
            "vllm.entrypoints.openai.run_batch",
            "-i",
            str(input_path),
            "-o",
            str(out),
            "--model",
            model,
            "--served-model-name",
            name,
            *ENGINE_ARGS,
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def run_dag(
    model: str,
    name: str,
    input_path: Path,
    out: Path,
    env: dict[str, str],
    concurrency: int,
    shard_requests: int,
) -> float:
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)
    started = time.monotonic()
    server = VLLMServer(VLLMServerSpec(model=model, served_model_name=name))
    # As in production, the batch is submitted while the server comes up: validate and
    # split overlap the engine's start, and dispatch waits for the endpoint.
    starting = server.start_in_background()
    try:
        conf = {
            "input_uri": str(input_path),
            "output_uri": str(out),
            "endpoint": server.base_url,
            "concurrency": concurrency,
            "requests_per_shard": shard_requests,
            "model": name,
        }
        log = WORK_DIR / "logs" / "bench-e2e-dag.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            subprocess.run(
                [airflow, "dags", "test", "batch_inference", "-c", json.dumps(conf)],
                env=env,
                check=True,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )
        starting.join()
        if server.startup_error is not None:
            raise server.startup_error
    finally:
        server.stop()
    return time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--shard-requests", type=int, default=5000)
    p.add_argument("--model", default=str(WORK_DIR / "models" / "tiny-llama"))
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds of both paths")
    args = p.parse_args()

    bench_dir = WORK_DIR / "bench" / "e2e"
    bench_dir.mkdir(parents=True, exist_ok=True)
    input_path = bench_dir / f"input-{args.requests}.jsonl"
    write_input(input_path, args.requests, args.served_model_name, args.max_tokens)
    env = {
        **os.environ,
        **airflow_env(bench_dir / "airflow"),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(WORK_DIR / "tmp"),
    }
    # Same CPU binding for both engines, whatever the machine's default.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    (WORK_DIR / "tmp").mkdir(parents=True, exist_ok=True)

    # Alternate the two paths so machine noise lands on both; compare medians.
    baseline_times: list[float] = []
    dag_times: list[float] = []
    answered_baseline = answered_dag = 0
    for round_no in range(1, args.repeats + 1):
        baseline_out = bench_dir / f"run_batch_output-{round_no}.jsonl"
        baseline_times.append(run_baseline(args.model, args.served_model_name, input_path, baseline_out, env))
        answered_baseline = count_lines(baseline_out)
        dag_out = bench_dir / f"dag_output-{round_no}"
        dag_times.append(
            run_dag(
                args.model,
                args.served_model_name,
                input_path,
                dag_out,
                env,
                args.concurrency,
                args.shard_requests,
            )
        )
        answered_dag = json.loads((dag_out / "batch.json").read_text())["request_counts"]["completed"]
        print(
            f"round {round_no}: run_batch {baseline_times[-1]:.1f} s, DAG {dag_times[-1]:.1f} s", flush=True
        )

    baseline_s = statistics.median(baseline_times)
    total_s = statistics.median(dag_times)
    ratio = (answered_dag / total_s) / (answered_baseline / baseline_s)
    print(
        f"{args.requests} chat requests, max_tokens={args.max_tokens}, model {args.model}, "
        f"median of {args.repeats} alternating rounds"
    )
    print(f"{'path':<38}{'seconds':>10}{'answered':>10}{'req/s':>10}")
    print(
        f"{'vLLM run_batch (baseline)':<38}{baseline_s:>10.1f}{answered_baseline:>10}"
        f"{answered_baseline / baseline_s:>10.1f}"
    )
    print(
        f"{'batch_inference DAG (server + DAG)':<38}{total_s:>10.1f}{answered_dag:>10}"
        f"{answered_dag / total_s:>10.1f}"
    )
    print(f"throughput ratio DAG / run_batch = {ratio:.3f} (target >= 0.9)")
    return 0 if ratio >= 0.9 and answered_dag == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
