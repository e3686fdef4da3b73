"""Live ETAs on the real stack (issue 40: "on the real stack (vLLM CPU, three concurrent batches),
within 25 % at 10 %"): how far the completion time the Batch API shows (``aibrix_estimate``) is from
when each batch really ends, read once the batch is 10 % answered.

One vLLM CPU server, one Airflow (api-server, scheduler, dag-processor, triggerer) serving the Batch
API; three batches submitted through the official ``openai`` SDK at the same moment, with tight,
moderate and relaxed windows (so deadline order decides who goes first) and different sizes and
``max_tokens``. Every ``--poll-s`` the bench retrieves each batch and keeps what it shows. The error
of an ETA read at time ``t`` is ``|eta - end| / (end - t)``: the share of the time still to go that
it was off by. Reported at 10 %, 25 % and 50 % answered, beside the baseline read from the same
poll: the batch's own rate since it went in progress (what the API showed before 2026-12-06).

    .venv/bin/python bench/eta_real_stack.py                      # ~5 min on 2 cores
    .venv/bin/python bench/eta_real_stack.py --sizes 600,1200,1800 --json /tmp/eta.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.integration.conftest: the deployment's allow-list the tests use

import openai  # noqa: E402

from aibrix_operators.batch_api.auth import key_digest  # noqa: E402
from aibrix_operators.batch_api.extensions import ESTIMATE  # noqa: E402
from aibrix_operators.local_airflow import AirflowDeployment, start_airflow  # noqa: E402
from aibrix_operators.localenv import WORK_DIR, airflow_env  # noqa: E402
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec  # noqa: E402
from tests.integration.conftest import allow_list_env  # noqa: E402

NAME = "tiny-llama"
TERMINAL = ("completed", "failed", "expired", "cancelled")
MARKS = (0.10, 0.25, 0.50)


def batch_file(n: int, max_tokens: tuple[int, int], seed: int) -> bytes:
    rng = random.Random(seed)
    words = "batch shard token cache decode prefill airflow model layer request".split()
    lines = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(10, 60)))
        body = {"model": NAME, "max_tokens": rng.randint(*max_tokens), "temperature": 0.0,
                "messages": [{"role": "user", "content": f"{i}: {prompt}"}]}
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def start_stack(work: Path, vllm_url: str, key: str) -> AirflowDeployment:
    home = work / "airflow"
    env = {**airflow_env(home), **allow_list_env(work)}
    env.update({
        "AIRFLOW__AIBRIX_BATCH__MIN_COMPLETION_WINDOW": "1m",
        "AIRFLOW__AIBRIX_BATCH__STATE_ROOT": str(work / "state"),
        "AIRFLOW__AIBRIX_BATCH__API_STORAGE_ROOT": str(work / "api"),
        "AIRFLOW__AIBRIX_BATCH__OUTPUT_ROOT": str(work / "outputs"),
        "AIRFLOW_VAR_AIBRIX_BATCH_API_KEYS": json.dumps({key_digest(key): "bench"}),
        "AIRFLOW__AIBRIX_BATCH__API_MODELS": f"{NAME}={vllm_url}",
        "AIRFLOW__AIBRIX_BATCH__API_DAG_CONF": json.dumps({"requests_per_shard": 200}),
    })
    env = {**os.environ, **env}
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(k, None)
    deployment = start_airflow(env, home)
    try:
        deployment.unpause("batch_inference")
    except BaseException:
        deployment.stop()
        raise
    return deployment


def run(sizes: list[int], windows: list[str], max_tokens: list[tuple[int, int]], poll_s: float,
        warmup: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="eta-bench-", dir="/var/tmp"))
    key = "sk-bench-" + secrets.token_hex(16)
    spec = VLLMServerSpec(model=str(WORK_DIR / "models" / NAME), served_model_name=NAME)
    with VLLMServer(spec) as server:
        deployment = start_stack(work, server.base_url, key)
        try:
            client = openai.OpenAI(base_url=deployment.api_url + "/openai/v1", api_key=key, max_retries=3,
                                   timeout=60)

            def submit(data: bytes, window: str) -> str:
                file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
                return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                             completion_window=window).id

            if warmup:  # a first batch teaches the deployment the endpoint's rate (admission's estimate)
                first = submit(batch_file(warmup, (8, 32), 99), "1h")
                while client.batches.retrieve(first).status not in TERMINAL:
                    time.sleep(poll_s)
            plan = enumerate(zip(sizes, windows, max_tokens, strict=True))
            ids = [submit(batch_file(n, mt, i), w) for i, (n, w, mt) in plan]
            polls: dict[str, list[dict]] = {b: [] for b in ids}
            ended: dict[str, dict] = {}
            while len(ended) < len(ids):
                for b in ids:
                    if b in ended:
                        continue
                    batch = client.batches.retrieve(b)
                    counts = batch.request_counts
                    polls[b].append({"t": time.time(), "status": batch.status,
                                     "answered": (counts.completed + counts.failed) if counts else 0,
                                     "total": counts.total if counts else 0,
                                     "tokens": batch.usage.total_tokens if batch.usage else None,
                                     "estimate": (batch.model_extra or {}).get(ESTIMATE)})
                    if batch.status in TERMINAL:
                        ended[b] = {"status": batch.status, "end": batch.completed_at or time.time(),
                                    "in_progress_at": batch.in_progress_at, "created_at": batch.created_at}
                time.sleep(poll_s)
        finally:
            deployment.stop()
    scored = zip(ids, sizes, windows, strict=True)
    return {"batches": [score(b, n, w, polls[b], ended[b]) for b, n, w in scored],
            "polls": polls, "ended": ended}


def score(batch_id: str, size: int, window: str, polls: list[dict], end: dict) -> dict:
    out = {"id": batch_id, "requests": size, "window": window, "status": end["status"],
           "seconds": round(end["end"] - end["created_at"], 1),
           "admitted_estimate": next((p["estimate"] for p in polls if p["estimate"]), None)}
    for mark in MARKS:
        seen = next((p for p in polls if p["total"] and p["answered"] >= mark * p["total"]
                     and p["status"] == "in_progress" and (p["estimate"] or {}).get("completion_at")), None)
        if seen is None:
            out[f"at_{int(mark * 100)}"] = None
            continue
        eta = seen["estimate"]["completion_at"]
        to_go = max(end["end"] - seen["t"], 1.0)
        # The baseline, from the same poll: the batch's own rate since it went in progress.
        elapsed = seen["t"] - end["in_progress_at"]
        own = seen["t"] + (seen["total"] - seen["answered"]) * elapsed / seen["answered"]
        out[f"at_{int(mark * 100)}"] = {"answered": seen["answered"], "eta_in_s": round(eta - seen["t"], 1),
                                        "ended_in_s": round(end["end"] - seen["t"], 1),
                                        "error": round(abs(eta - end["end"]) / to_go, 3),
                                        "own_rate_error": round(abs(own - end["end"]) / to_go, 3),
                                        "basis": seen["estimate"].get("basis")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="600,1200,1800", help="requests in each of the three batches")
    p.add_argument("--windows", default="30m,1h,2h", help="their completion windows")
    p.add_argument("--max-tokens", default="8-24,16-48,8-64", help="each batch's max_tokens range")
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=200, help="requests of a first batch (0: none)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    ranges = [tuple(int(x) for x in r.split("-")) for r in args.max_tokens.split(",")]
    result = run([int(s) for s in args.sizes.split(",")], args.windows.split(","), ranges, args.poll_s,
                 args.warmup)
    for b in result["batches"]:
        print(json.dumps({k: v for k, v in b.items() if k != "admitted_estimate"}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
