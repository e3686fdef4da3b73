"""LoRA adapters as batch models, end to end: `airflow dags test batch_inference` against a real
vLLM CPU server that loads adapters at run time, the adapters pulled from a real SeaweedFS.

Three adapters (``inference_images/vllm/make_lora.py``, seeded) and the base model are mixed in
one batch. Each answer must be the one a server started with that adapter preloaded
(``--lora-modules``) gives: greedy tokens, compared exactly. A fourth adapter is published with
one byte flipped after its manifest was pinned: its shard fails with the adapter's name while the
batch's other shards are answered.
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.local_airflow import wait_until
from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec, free_port
from aibrix_operators.serving.model_manifest import MANIFEST_NAME, write_manifest
from tests.integration.conftest import INFERENCE_PYTHON, SERVED_NAME, dags_test, read_jsonl, write_jsonl
from tests.integration.services import S3Server

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
BUCKET = "lora-test"
ADAPTERS = {"a1": 1, "a2": 2, "a3": 3}  # name -> make_lora seed
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "4"]
PROMPTS = 6


def make_adapters(tiny_model: Path, root: Path, seeds: dict[str, int]) -> dict[str, Path]:
    made = {}
    for name, seed in seeds.items():
        out = root / name
        subprocess.run([str(INFERENCE_PYTHON), str(REPO_ROOT / "inference_images/vllm/make_lora.py"),
                        str(tiny_model), str(out), "--seed", str(seed)], check=True)
        write_manifest(out)
        made[name] = out
    return made


def publish(s3: S3Server, folder: Path, flip_byte_of: str | None = None) -> str:
    """Upload an adapter folder (its manifest included) under a fresh prefix; its URI. With
    ``flip_byte_of``, that file goes up with one byte changed: the manifest no longer matches."""
    prefix = f"{folder.name}-{uuid.uuid4().hex[:8]}"
    client = s3.client()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        data = path.read_bytes()
        if path.name == flip_byte_of:
            data = data[:100] + bytes([data[100] ^ 0x01]) + data[101:]
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=data)
    return f"s3://{BUCKET}/{prefix}/"


def pin(folder: Path) -> str:
    return hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def lora_setup(tiny_model: Path, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    client = s3_server.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    root = tmp_path_factory.mktemp("adapters")
    folders = make_adapters(tiny_model, root, {**ADAPTERS, "broken": 4})
    entries = [{"name": name, "base_model": SERVED_NAME, "manifest_sha256": pin(folder),
                "uri": publish(s3_server, folder, "adapter_model.safetensors" if name == "broken" else None)}
               for name, folder in folders.items()]
    registry = root / "lora-adapters.json"
    registry.write_text(json.dumps({"adapters": entries}))
    # The router's admin token, a Secret both the router and the workers mount.
    token = root / "router-admin-token"
    token.write_text(secrets.token_hex(32) + "\n")
    return {"folders": folders, "registry": registry, "cache": root / "cache", "admin_token": token}


@pytest.fixture(scope="module")
def runtime_server(tiny_model: Path) -> Iterator[VLLMServer]:
    """What the deployment runs: no adapter preloaded, runtime loading allowed."""
    spec = VLLMServerSpec(model=str(tiny_model), served_model_name=SERVED_NAME, max_model_len=1024,
                          compact_engine=True, extra_args=LORA_ARGS,
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    with VLLMServer(spec) as server:
        yield server


def requests(models: list[str], seed: int = 5) -> list[dict]:
    """Every prompt under every model, shuffled: adapters interleaved in input order."""
    rows = [(p, m) for p in range(PROMPTS) for m in models]
    random.Random(seed).shuffle(rows)
    return [{"custom_id": f"p{p}-{m}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": m, "max_tokens": 8, "temperature": 0.0,
                      "messages": [{"role": "user", "content": f"Prompt {p}: tell me about rivers"}]}}
            for p, m in rows]


def lora_env(env: dict[str, str], s3: S3Server, setup: dict) -> dict[str, str]:
    return {**env, **s3.env(),
            "AIRFLOW__AIBRIX_BATCH__LORA_ADAPTERS": str(setup["registry"]),
            "AIRFLOW__AIBRIX_BATCH__LORA_CACHE_DIR": str(setup["cache"]),
            "AIRFLOW__AIBRIX_BATCH__ROUTER_ADMIN_TOKEN_FILE": str(setup["admin_token"])}


def run_batch(env: dict[str, str], s3: S3Server, setup: dict, endpoint: str, batch: list[dict],
              tmp_path: Path, **params: int) -> subprocess.CompletedProcess:
    """batch_inference on ``batch`` under the deployment's adapter registry; output in tmp_path/out."""
    return dags_test(lora_env(env, s3, setup), {
        "input_uri": str(write_jsonl(tmp_path / "input.jsonl", batch)), "output_uri": str(tmp_path / "out"),
        "endpoint": endpoint, "model": SERVED_NAME, **params,
    }, tmp_path / "logs")


def answer(record: dict) -> str:
    return record["response"]["body"]["choices"][0]["message"]["content"]


def post(base_url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def shard_models(out: Path) -> list[set[str]]:
    files = sorted(out.rglob("shard-*.jsonl"))
    assert files, f"no shard files under {out}"
    return [{json.loads(raw)["body"]["model"] for raw in f.read_text().splitlines()} for f in files]


def test_mixed_adapters_answered_by_their_adapters(
    airflow_session_env: dict[str, str], s3_server: S3Server, lora_setup: dict,
    runtime_server: VLLMServer, tmp_path: Path,
) -> None:
    batch = requests([SERVED_NAME, *ADAPTERS])
    out = tmp_path / "out"
    proc = run_batch(airflow_session_env, s3_server, lora_setup, runtime_server.base_url, batch, tmp_path,
                     requests_per_shard=4, concurrency=1)
    assert proc.returncode == 0, proc.stdout[-5000:]
    output = read_jsonl((out / "output.jsonl").read_text())
    assert (out / "errors.jsonl").read_text() == ""
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in batch]  # input order

    # Grouped: no shard file mixes models, and each model's shards are back to back.
    per_shard = shard_models(out)
    assert all(len(models) == 1 for models in per_shard), per_shard
    order = [next(iter(m)) for m in per_shard]
    assert len([m for k, m in enumerate(order) if k == 0 or order[k - 1] != m]) == 4, order

    # Loaded at run time, from the verified cache.
    with urllib.request.urlopen(f"{runtime_server.base_url}/v1/models", timeout=10) as resp:
        roots = {c["id"]: c.get("root") for c in json.loads(resp.read())["data"]}
    for name in ADAPTERS:
        assert str(lora_setup["cache"] / name) in roots[name], roots

    got = {r["custom_id"]: answer(r) for r in output}
    for name in ADAPTERS:  # the adapters change the answers, so serving the base would be caught
        differ = sum(got[f"p{p}-{name}"] != got[f"p{p}-{SERVED_NAME}"] for p in range(PROMPTS))
        assert differ >= PROMPTS // 2, (name, differ)

    # The reference: each adapter loaded again straight from its source folder, under a name of
    # its own (so a cache that mixed two adapters up would be caught), one request at a time.
    # On the same server rather than a second one started with the adapters preloaded: the same
    # answers, without a vLLM start's ~25 CPU-seconds.
    base_url, reference = runtime_server.base_url, {name: f"ref-{name}" for name in ADAPTERS}
    for name, ref in reference.items():
        lora_admin(base_url, "load", {"lora_name": ref, "lora_path": str(lora_setup["folders"][name])})
    try:
        want = {}
        for r in batch:
            body = {**r["body"], "model": reference.get(r["body"]["model"], SERVED_NAME)}
            want[r["custom_id"]] = post(base_url, body)["choices"][0]["message"]["content"]
    finally:
        for ref in reference.values():
            lora_admin(base_url, "unload", {"lora_name": ref})
    assert got == want


def test_corrupted_adapter_fails_its_shard_by_name(
    airflow_session_env: dict[str, str], s3_server: S3Server, lora_setup: dict,
    runtime_server: VLLMServer, tmp_path: Path,
) -> None:
    batch = requests([SERVED_NAME, "a1", "broken"], seed=6)
    out = tmp_path / "out"
    proc = run_batch(airflow_session_env, s3_server, lora_setup, runtime_server.base_url, batch, tmp_path,
                     requests_per_shard=6, concurrency=2)
    assert proc.returncode != 0
    record = json.loads((out / "batch.json").read_text())
    assert record["status"] == "failed"
    (error,) = record["errors"]["data"]
    assert error["code"] == "adapter_load_failed", error
    assert "LoRA adapter 'broken'" in error["message"] and "adapter_model.safetensors" in error["message"]
    # The broken adapter never reached the server; the other shards were answered.
    with urllib.request.urlopen(f"{runtime_server.base_url}/v1/models", timeout=10) as resp:
        served = {c["id"] for c in json.loads(resp.read())["data"]}
    assert "broken" not in served and "a1" in served
    segments = [f for f in out.rglob("*.jsonl") if "results" in f.parts]
    answered = {json.loads(line)["custom_id"] for f in segments
                for line in f.read_text().splitlines() if line.strip()}
    assert answered == {r["custom_id"] for r in batch if r["body"]["model"] != "broken"}


@pytest.fixture(scope="module")
def router_over_two(
    tiny_model: Path, runtime_server: VLLMServer, lora_setup: dict,
) -> Iterator[tuple[str, str]]:
    """The P/D router with two decode instances: the module's server and a second, fresh one; it
    loads the deployment's adapters for whoever holds the admin token."""
    spec = VLLMServerSpec(model=str(tiny_model), served_model_name=SERVED_NAME, max_model_len=1024,
                          compact_engine=True, extra_args=LORA_ARGS,
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    with VLLMServer(spec) as second:
        port = free_port()
        log = open(REPO_ROOT / ".work" / f"router-{port}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "aibrix_operators.router", "--host", "127.0.0.1", "--port", str(port),
             "--decode", runtime_server.base_url, "--decode", second.base_url,
             "--health-interval-s", "0.5", "--shutdown-timeout-s", "2",
             "--admin-token-file", str(lora_setup["admin_token"]),
             "--lora-registry", str(lora_setup["registry"]), "--lora-cache-dir", str(lora_setup["cache"])],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: urllib.request.urlopen(url + "/health", timeout=2).status == 200, 30,
                       "the router", proc, Path(log.name))
            yield url, second.base_url
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            log.close()


def served_adapters(base_url: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as resp:
        return {c["id"]: c.get("root") for c in json.loads(resp.read())["data"]}


def test_through_the_router_every_instance_gets_the_adapters(
    airflow_session_env: dict[str, str], s3_server: S3Server, lora_setup: dict,
    runtime_server: VLLMServer, router_over_two: tuple[str, str], tmp_path: Path,
) -> None:
    router, second = router_over_two
    batch = requests([SERVED_NAME, "a1", "a2"], seed=7)
    proc = run_batch(airflow_session_env, s3_server, lora_setup, router, batch, tmp_path,
                     requests_per_shard=6, concurrency=4)
    assert proc.returncode == 0, proc.stdout[-5000:]
    output = read_jsonl((tmp_path / "out" / "output.jsonl").read_text())
    assert (tmp_path / "out" / "errors.jsonl").read_text() == ""
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in batch]
    # The load reached both instances (the fresh one had neither adapter), from the same folders.
    first, fresh = served_adapters(runtime_server.base_url), served_adapters(second)
    for name in ("a1", "a2"):
        assert fresh[name] == first[name] and str(lora_setup["cache"] / name) in fresh[name]
    # The batch loaded them with the workers' admin token; a client without it loads nothing (the
    # review's attack: the base model's name with a bogus folder, which made it answer 503).
    with pytest.raises(urllib.error.HTTPError) as refused:
        lora_admin(router, "load", {"lora_name": SERVED_NAME, "lora_path": "/nonexistent"})
    assert refused.value.code == 401
    assert post(router, {**batch[0]["body"], "model": SERVED_NAME})["choices"]


def test_an_unknown_adapter_is_refused_at_validation_with_its_line(
    airflow_session_env: dict[str, str], s3_server: S3Server, lora_setup: dict, tmp_path: Path,
) -> None:
    batch = requests([SERVED_NAME, "a1"], seed=8)
    batch[5]["body"]["model"] = "a9"  # not in the deployment's registry
    proc = run_batch(airflow_session_env, s3_server, lora_setup, "http://127.0.0.1:9", batch, tmp_path,
                     requests_per_shard=6)
    assert proc.returncode != 0
    record = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert record["status"] == "failed"
    (error,) = record["errors"]["data"]
    assert (error["code"], error["line"], error["param"]) == ("unknown_model", 6, "body.model")
    assert "'a9' is neither the batch's model 'tiny-llama' nor one of its LoRA adapters" in error["message"]
    assert not (tmp_path / "out" / "output.jsonl").exists()  # nothing was sent


def lora_admin(base_url: str, action: str, body: dict) -> None:
    """``POST /v1/load_lora_adapter`` or ``/v1/unload_lora_adapter``."""
    req = urllib.request.Request(f"{base_url}/v1/{action}_lora_adapter", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200, resp.status


def test_an_adapter_the_server_loses_mid_shard_pauses_the_shard_not_its_requests(
    runtime_server: VLLMServer, lora_setup: dict, tmp_path: Path,
) -> None:
    """vLLM forgets an adapter mid-shard, as a restart without the run-time loads does. Its 404s
    ("the model does not exist") are the endpoint's fault: the shard pauses and resumes when the
    adapter is back, and no request ends as an error line. Gone past the outage budget, the shard
    fails instead (the task's failure, retried) and its retry, after the adapter is loaded again
    (what dispatch's prepare_adapter does), answers the rest, each request once."""
    import asyncio
    import threading
    import time

    from aibrix_operators.batch.shard_results import shard_result_log
    from aibrix_operators.driver.config import DriverConfig
    from aibrix_operators.driver.health import EndpointOutage
    from aibrix_operators.driver.runner import run_shard
    from aibrix_operators.storage import LocalStorage

    # Each shard outlasts its first checkpoint (10 answers) by seconds: the adapter is lost while
    # most of its requests wait. 96, not 240 as until 2026-12-07: the same paths at 40 % of the tokens.
    shard_size = 96
    base, name = runtime_server.base_url, "lost-a1"
    load = {"lora_name": name, "lora_path": str(lora_setup["folders"]["a1"])}
    lora_admin(base, "load", load)
    storage = LocalStorage()

    def shard_of(tag: str, n: int) -> tuple[str, str]:
        rows = [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": name, "max_tokens": 16, "temperature": 0.0,
                          "messages": [{"role": "user", "content": f"Question {i}: where do rivers go?"}]}}
                for i in range(n)]
        return str(write_jsonl(tmp_path / f"{tag}.jsonl", rows)), str(tmp_path / f"{tag}-results")

    def config(budget_s: float) -> DriverConfig:
        return DriverConfig(endpoint=base, concurrency=4, api_key_env=None, flush_every=10,
                            flush_interval_s=0.2, backoff_base_s=0.05, probe_interval_s=0.2,
                            outage_budget_s=budget_s)

    def lose_after_first_checkpoint(shard: str, prefix: str, back_after_s: float | None) -> threading.Thread:
        def run() -> None:
            log = shard_result_log(storage, prefix, shard)
            deadline = time.monotonic() + 120
            while not log.segments() and time.monotonic() < deadline:
                time.sleep(0.02)
            lora_admin(base, "unload", {"lora_name": name})
            if back_after_s is not None:
                time.sleep(back_after_s)
                lora_admin(base, "load", load)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def answers(shard: str, prefix: str) -> list[dict]:
        log = shard_result_log(storage, prefix, shard)
        return [json.loads(line) for seg in log.segments()
                for line in storage.read_bytes(seg).decode().splitlines() if line]

    # Lost for 3 s, inside the outage budget: paused, then every request answered.
    shard, prefix = shard_of("pause", shard_size)
    loser = lose_after_first_checkpoint(shard, prefix, back_after_s=3.0)
    outcome = asyncio.run(run_shard(storage, shard, prefix, config(120.0), total=shard_size))
    loser.join()
    got = answers(shard, prefix)
    assert outcome.failed == 0 and outcome.outages >= 1, (outcome, [r for r in got if r["error"]])
    assert sorted(r["custom_id"] for r in got) == sorted(f"pause-{i}" for i in range(shard_size))
    assert all(r["error"] is None for r in got)

    # Lost for good: the shard fails past its 3 s budget with nothing recorded for the rest; the
    # retry after a reload answers them.
    shard, prefix = shard_of("retry", shard_size)
    loser = lose_after_first_checkpoint(shard, prefix, back_after_s=None)
    with pytest.raises(EndpointOutage):
        asyncio.run(run_shard(storage, shard, prefix, config(3.0), total=shard_size))
    loser.join()
    first = answers(shard, prefix)
    assert 0 < len(first) < shard_size and all(r["error"] is None for r in first)
    lora_admin(base, "load", load)
    outcome = asyncio.run(run_shard(storage, shard, prefix, config(120.0), total=shard_size))
    got = answers(shard, prefix)
    assert outcome.failed == 0
    assert sorted(r["custom_id"] for r in got) == sorted(f"retry-{i}" for i in range(shard_size))
    assert all(r["error"] is None for r in got)
    lora_admin(base, "unload", {"lora_name": name})
