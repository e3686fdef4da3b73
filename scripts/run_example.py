"""`make run`: serve the local model, run batch_inference on the example, print a summary.

Starts a vLLM CPU server on the generated model, runs the DAG in-process with
``airflow dags test``, stops the server, and prints where the results are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aibrix_operators.localenv import REPO_ROOT, WORK_DIR, airflow_env
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec

AIRFLOW = str(Path(sys.executable).with_name("airflow"))


# A line at least this often while the DAG runs: the first run waits minutes for vLLM to start.
PROGRESS_INTERVAL_S = 15.0
# The task a `dags test` log line is about (Airflow's TaskInstance repr, or its task_id= fields).
_TASK = re.compile(r"TaskInstance: batch_inference\.(\w+)|task_id=['\"]?(\w+)")


def last_task(log_path: Path) -> str | None:
    """The task the DAG's log mentions last (the one running, or the last to end)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    found = _TASK.findall(tail)
    return next((a or b for a, b in reversed(found) if a or b), None)


def wait_with_progress(proc: subprocess.Popen, describe: Callable[[], str], interval_s: float,
                       started: float) -> int:
    """Wait for ``proc``, printing what it waits for every ``interval_s``."""
    while True:
        try:
            return proc.wait(timeout=interval_s)
        except subprocess.TimeoutExpired:
            print(f"  [{time.monotonic() - started:4.0f} s] {describe()}", flush=True)


def run_dag(conf: dict, env: dict[str, str], log_path: Path, describe: Callable[[], str]) -> int:
    # A fresh checkout's first migrate creates the SQLite DB: tens of seconds, so say so.
    print("creating/upgrading the Airflow DB (.work/airflow) ...", flush=True)
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True)
    print(f"running DAG batch_inference (log: {log_path}) ...", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [AIRFLOW, "dags", "test", "batch_inference", "-c", json.dumps(conf)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )
        return wait_with_progress(proc, describe, PROGRESS_INTERVAL_S, time.monotonic())


def summary(batch: dict, wall_s: float, output: Path) -> str:
    counts = batch["request_counts"]
    usage = batch.get("usage") or {}
    busy_s = batch["finalizing_at"] - batch["in_progress_at"]
    return "\n".join([
        f"batch {batch['id']}: {batch['status']}",
        f"  requests   total={counts['total']} completed={counts['completed']} failed={counts['failed']}",
        f"  tokens     input={usage.get('input_tokens', 0)} output={usage.get('output_tokens', 0)}",
        f"  wall time  {wall_s:.1f} s (DAG run, including the server's start)",
        f"  inference  {busy_s} s from first request to merge: "
        f"{counts['total'] / max(busy_s, 1):.1f} requests/s",
        f"  results    {output}/output.jsonl",
        f"             {output}/errors.jsonl",
        f"             {output}/batch.json",
    ])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(WORK_DIR / "models" / "tiny-llama"))
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--input", default=str(REPO_ROOT / "examples" / "chat_batch.jsonl"))
    p.add_argument("--output", default=str(WORK_DIR / "outputs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = p.parse_args()

    env = {**os.environ, **airflow_env()}
    log_path = WORK_DIR / "logs" / "make-run-dag.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(VLLMServerSpec(model=args.model, served_model_name=args.served_model_name))
    print(f"starting vLLM on {args.model} at {server.base_url}, and running DAG batch_inference "
          "(dispatch waits for the server) ...", flush=True)
    starting = server.start_in_background()
    try:
        conf = {"input_uri": args.input, "output_uri": args.output, "endpoint": server.base_url,
                "model": args.served_model_name}
        started = time.monotonic()

        def describe() -> str:
            task = last_task(log_path) or "starting"
            if starting.is_alive():
                return (f"vLLM is still starting at {server.base_url} (~1-3 min on a CPU; the dispatch "
                        f"step waits for it); DAG at: {task}")
            return f"vLLM is up; DAG at: {task} (log: {log_path})"

        rc = run_dag(conf, env, log_path, describe)
        wall = time.monotonic() - started
        starting.join()
    finally:
        server.stop()
    print("vLLM stopped.")
    if server.startup_error is not None:
        print(f"vLLM failed to start: {server.startup_error}", file=sys.stderr)
        return 1
    batch_path = Path(args.output) / "batch.json"
    if rc != 0 or not batch_path.exists():
        print(f"DAG run failed (exit {rc}); task logs: {log_path}", file=sys.stderr)
        if batch_path.exists():
            print(batch_path.read_text(), file=sys.stderr)
        return 1
    print(summary(json.loads(batch_path.read_text()), wall, Path(args.output)))
    print(f"  DAG log    {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
