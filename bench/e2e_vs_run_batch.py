"""End-to-end overhead: the batch_inference DAG vs vLLM's own `run_batch`, same input.

Both paths start the same vLLM engine on the same model with the same engine
arguments, answer the same requests, and write OpenAI batch output; each is
timed from launch until its results are on disk and its processes have exited.
The DAG path starts the server and submits the batch at the same moment
(dispatch waits for the endpoint), as a user of a scale-from-zero deployment would.

Two ways to submit the DAG run:
  --trigger rest       (default) through the REST API of an Airflow that is already running
                       (api-server, scheduler, dag-processor, triggerer started before the
                       clock, as in production); tasks run in LocalExecutor worker processes.
  --trigger dags-test  `airflow dags test` in-process: includes Airflow's own ~15 CPU-seconds
                       of boot (CLI import, in-process execution API), which competes with the
                       engine's start on a 2-core machine.

    .venv/bin/python bench/e2e_vs_run_batch.py --requests 5000 [--trigger dags-test]

Rounds alternate the two paths so machine noise lands on both; the medians are
compared. Prints both times and the throughput ratio (DAG / run_batch; target ≥ 0.9).
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
from collections.abc import Callable
from pathlib import Path

from aibrix_operators.local_airflow import AirflowDeployment, start_airflow, trigger_and_wait
from aibrix_operators.localenv import REPO_ROOT, WORK_DIR, airflow_env
from aibrix_operators.serving.local_vllm import (
    DEFAULT_PYTHON,
    VLLMServer,
    VLLMServerSpec,
    stop_process_group,
)

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "4096",
               "--kv-cache-memory-bytes", str(512 << 20), "--enforce-eager"]


def write_input(path: Path, n: int, model: str, max_tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "batch shard token cache decode prefill airflow model layer request".split()
    with open(path, "w") as fh:
        for i in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                    "messages": [{"role": "user", "content": f"{i}: {prompt}"}]}
            fh.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}) + "\n")


def count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def run_baseline(model: str, name: str, input_path: Path, out: Path, env: dict[str, str],
                 engine_args: list[str] | None = None) -> float:
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(DEFAULT_PYTHON), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(input_path),
         "-o", str(out), "--model", model, "--served-model-name", name,
         *(ENGINE_ARGS if engine_args is None else engine_args)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # so an interrupted bench takes the engine processes too
    )
    try:
        if proc.wait() != 0:
            raise RuntimeError(f"run_batch exited with {proc.returncode}")
    finally:
        stop_process_group(proc)
    return time.monotonic() - started


def submit_with_dags_test(conf: dict, env: dict[str, str]) -> None:
    airflow = str(Path(sys.executable).with_name("airflow"))
    log = WORK_DIR / "logs" / "bench-e2e-dag.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        subprocess.run([airflow, "dags", "test", "batch_inference", "-c", json.dumps(conf)],
                       env=env, check=True, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO_ROOT)


def submit_with_rest(conf: dict, deployment: AirflowDeployment) -> None:
    run = trigger_and_wait(deployment, "batch_inference", conf)
    if run["state"] != "success":
        raise RuntimeError(f"DAG run {run['dag_run_id']} ended {run['state']}")


def bench_env(bench_dir: Path, trigger: str) -> dict[str, str]:
    """The bench's Airflow environment: its own home under ``bench_dir``, offline, our TMPDIR, and
    the same CPU binding for both engines whatever the machine's default."""
    (WORK_DIR / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **airflow_env(bench_dir / f"airflow-{trigger}"), "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(WORK_DIR / "tmp")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    return env


def dag_submitter(
    trigger: str, env: dict[str, str]
) -> tuple[Callable[[dict], None], AirflowDeployment | None]:
    """How the bench hands a batch to the DAG: a running Airflow's REST API (``rest``; the
    deployment is returned for the caller to stop) or ``airflow dags test`` on a migrated database."""
    if trigger == "rest":
        deployment = start_airflow(env, Path(env["AIRFLOW_HOME"]))
        return (lambda conf: submit_with_rest(conf, deployment)), deployment
    subprocess.run([str(Path(sys.executable).with_name("airflow")), "db", "migrate"], env=env,
                   check=True, capture_output=True)
    return (lambda conf: submit_with_dags_test(conf, env)), None


def run_dag(model: str, name: str, input_path: Path, out: Path, submit,
            spec: VLLMServerSpec | None = None, conf: dict | None = None) -> float:
    """``spec`` (default: the engine of ENGINE_ARGS) must match the baseline's engine arguments."""
    started = time.monotonic()
    server = VLLMServer(spec or VLLMServerSpec(model=model, served_model_name=name))
    starting = server.start_in_background()
    try:
        submit({"input_uri": str(input_path), "output_uri": str(out), "endpoint": server.base_url,
                "concurrency": 256, "model": name, **(conf or {})})
        starting.join()
        if server.startup_error is not None:
            raise server.startup_error
    finally:
        server.stop()
    return time.monotonic() - started


def add_stack_args(p: argparse.ArgumentParser, repeats: int, repeats_help: str) -> None:
    """The options every bench that runs the DAG beside run_batch takes (prefix_batching.py too):
    the model, its served name, how many alternating rounds, and how the DAG is triggered."""
    p.add_argument("--model", default=str(WORK_DIR / "models" / "tiny-llama"))
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    p.add_argument("--trigger", choices=["rest", "dags-test"], default="rest")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=16)
    add_stack_args(p, 2, "alternating rounds of both paths")
    args = p.parse_args()

    bench_dir = WORK_DIR / "bench" / "e2e"
    bench_dir.mkdir(parents=True, exist_ok=True)
    input_path = bench_dir / f"input-{args.requests}.jsonl"
    write_input(input_path, args.requests, args.served_model_name, args.max_tokens)
    env = bench_env(bench_dir, args.trigger)
    submit, deployment = dag_submitter(args.trigger, env)

    baseline_times: list[float] = []
    dag_times: list[float] = []
    answered_baseline = answered_dag = 0
    try:
        for round_no in range(1, args.repeats + 1):
            baseline_out = bench_dir / f"run_batch_output-{round_no}.jsonl"
            baseline_times.append(
                run_baseline(args.model, args.served_model_name, input_path, baseline_out, env))
            answered_baseline = count_lines(baseline_out)
            dag_out = bench_dir / f"dag_output-{args.trigger}-{round_no}"
            dag_times.append(run_dag(args.model, args.served_model_name, input_path, dag_out, submit))
            batch = json.loads((dag_out / "batch.json").read_text())
            answered_dag = batch["request_counts"]["completed"]
            print(f"round {round_no}: run_batch {baseline_times[-1]:.1f} s, "
                  f"DAG ({args.trigger}) {dag_times[-1]:.1f} s", flush=True)
    finally:
        if deployment is not None:
            deployment.stop()

    baseline_s = statistics.median(baseline_times)
    dag_s = statistics.median(dag_times)
    ratio = (answered_dag / dag_s) / (answered_baseline / baseline_s)
    print(f"{args.requests} chat requests, max_tokens={args.max_tokens}, model {args.model}, "
          f"median of {args.repeats} alternating rounds, DAG submitted via {args.trigger}")
    print(f"{'path':<40}{'seconds':>10}{'answered':>10}{'req/s':>10}")
    print(f"{'vLLM run_batch (baseline)':<40}{baseline_s:>10.1f}{answered_baseline:>10}"
          f"{answered_baseline / baseline_s:>10.1f}")
    print(f"{'batch_inference DAG (server start + run)':<40}{dag_s:>10.1f}{answered_dag:>10}"
          f"{answered_dag / dag_s:>10.1f}")
    print(f"throughput ratio DAG / run_batch = {ratio:.3f} (target >= 0.9)")
    return 0 if ratio >= 0.9 and answered_dag == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
