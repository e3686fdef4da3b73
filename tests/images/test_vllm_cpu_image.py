"""The vLLM CPU image, built from inference_images/vllm_cpu/Dockerfile, serves the generated
tiny model (mounted read-only) with our kvcache connector configured: /v1/models and one chat
request, answered by the container's vLLM with the connector loaded in both halves."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from aibrix_operators.serving.local_vllm import free_port
from tests.images.containers import Detached, answers_200, inspect

pytestmark = [pytest.mark.e2e, pytest.mark.waits]  # its own lane: docs/testing.md

KV_TRANSFER = {
    "kv_connector": "KVCacheConnector", "kv_connector_module_path": "kvcache.connector",
    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"l1_capacity_bytes": 64 << 20},
}  # fmt: skip


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def test_the_vllm_cpu_container_serves_with_the_kvcache_connector(vllm_cpu_image, tiny_model, tmp_path):
    port = free_port()
    # A copy the image's user (uid 65532) may read: the generated files are the owner's only.
    model = Path(shutil.copytree(tiny_model, tmp_path / "tiny-llama"))
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    args = ["--model", "/models/tiny-llama", "--served-model-name", "tiny-llama", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
            "--kv-cache-memory-bytes", str(256 << 20), "--kv-transfer-config", json.dumps(KV_TRANSFER)]
    # one core, as the kvcache suites pin their servers (ARCHITECTURE §4)
    # vLLM puts its IPC buffers in /dev/shm (160 MiB here): podman gives 64 MiB unless told
    flags = ["-v", f"{model}:/models/tiny-llama:ro,Z", "-e", "VLLM_CPU_OMP_THREADS_BIND=0",
             "--shm-size", "1g"]
    with Detached(vllm_cpu_image, *args, flags=flags) as server:
        base = f"http://127.0.0.1:{port}"

        server.wait_until(answers_200(base + "/health"), 300, "vLLM from the vllm-cpu image")
        models = _get(base + "/v1/models")
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        body = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "say something about batches"}]}  # fmt: skip
        request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.load(resp)
        log = server.logs()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 6, answer
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    # The connector was loaded from the installed kvcache package, on both sides.
    assert "kvcache: SCHEDULER side" in log and "kvcache: WORKER side" in log, log[-3000:]
    assert inspect(vllm_cpu_image, "{{.Config.User}}") == "65532:65532"
