"""The quick start's stack: vLLM (CPU, the generated model) and Airflow with the Batch API.

    .venv/bin/python scripts/serve_batch_api.py        # Ctrl-C or SIGTERM stops everything

Starts vLLM on 127.0.0.1:8000 and Airflow's api-server, scheduler, dag-processor and triggerer
(AIRFLOW_HOME=.work/airflow, the api-server on 127.0.0.1:8080), unpauses batch_inference, and
configures one Batch API tenant ("local") whose key is kept in .work/batch-api-key (0600,
created once). Prints the two environment variables the CLI and the SDK read on a line that
starts with ``ready``, or one line that starts with ``failed`` (what to do) when it cannot start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from aibrix_operators.batch_api.auth import key_digest
from aibrix_operators.local_airflow import start_airflow
from aibrix_operators.localenv import WORK_DIR, airflow_env
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec

KEY_FILE = WORK_DIR / "batch-api-key"


def local_key() -> str:
    if not KEY_FILE.exists():
        KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("sk-local-" + secrets.token_hex(16))
    return KEY_FILE.read_text().strip()


def failed(reason: str) -> int:
    """The one line the quick start's wait loop stops on (it waits for ``^ready`` or ``^failed``)."""
    print(f"failed: {reason}", flush=True)
    return 1


def main() -> int:
    try:
        return serve()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the traceback is above; the loop needs the one line
        import traceback

        traceback.print_exc()
        return failed(f"{type(exc).__name__}: {exc} (the traceback above says where)")


def serve() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(WORK_DIR / "models" / "tiny-llama"))
    p.add_argument("--served-model-name", default="tiny-llama")
    p.add_argument("--port", type=int, default=8080, help="the api-server's port")
    p.add_argument("--vllm-port", type=int, default=8000)
    args = p.parse_args()
    if not (Path(args.model) / "config.json").exists():
        return failed(f"no model at {args.model}: run `make run` first (it sets up both environments "
                      "and generates the model), or pass --model")
    key = local_key()
    home = WORK_DIR / "airflow"
    spec = VLLMServerSpec(model=args.model, served_model_name=args.served_model_name, port=args.vllm_port)
    print("starting vLLM and Airflow (about a minute on a CPU)…", file=sys.stderr, flush=True)
    with VLLMServer(spec) as vllm:
        env = {**os.environ, **airflow_env(home),
               # Only the key's digest is configured; the key itself stays in KEY_FILE.
               "AIRFLOW_VAR_AIBRIX_BATCH_API_KEYS": json.dumps({key_digest(key): "local"}),
               "AIRFLOW__AIBRIX_BATCH__API_MODELS": f"{args.served_model_name}={vllm.base_url}"}
        airflow = start_airflow(env, home, port=args.port)
        try:
            deadline = time.monotonic() + 120
            while True:  # the dag-processor parses the DAG folder shortly after start
                try:
                    airflow.api("PATCH", "/api/v2/dags/batch_inference", {"is_paused": False})
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            print(f"ready: Airflow UI {airflow.api_url} (admin / {airflow.admin_password()}), "
                  f"model {args.served_model_name}\n"
                  f"export AIBRIX_BATCH_BASE_URL={airflow.api_url} OPENAI_API_KEY=$(cat {KEY_FILE})",
                  flush=True)
            # Wait for Ctrl-C or a SIGTERM, then stop the components (finally) and vLLM (with).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            airflow.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
