"""Prefix grouping end to end: `airflow dags test` → a real vLLM CPU server with prefix caching.

The same shared-prefix batch (few-shot templates of ~600 tokens, questions shuffled across the
file) runs twice, ``prefix_grouping=auto`` and ``off``; both must answer every request once in
input order, and with grouping the server must report (``usage.prompt_tokens_details.
cached_tokens``, ``--enable-prompt-tokens-details``) far more cached prompt tokens.

The server is this module's own, with a KV cache of ~3k tokens: the templates' KV (~7k tokens)
is more than twice the cache, the situation grouping is for. The session's ``vllm_chat`` has a
512 MB cache (131k tokens of the tiny model), which holds every template of a test-sized batch
in any order, so there both orders would hit alike.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from aibrix_operators.serving.local_vllm import VLLMServer, VLLMServerSpec
from tests.integration.conftest import SERVED_NAME, dags_test, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e

GROUPS, MEMBERS = 12, 8
KV_TOKENS = 3072  # 4 KiB of KV per token: 4 layers x 2 KV heads x 64 x 2 (K, V) x fp32


@pytest.fixture(scope="module")
def small_cache_server(tiny_model: Path) -> Iterator[VLLMServer]:
    spec = VLLMServerSpec(model=str(tiny_model), served_model_name=SERVED_NAME, max_model_len=2048,
                          kv_cache_bytes=KV_TOKENS * 4096, compact_engine=True,
                          extra_args=["--enable-prompt-tokens-details", "--enable-prefix-caching"])
    with VLLMServer(spec) as server:
        yield server


def shared_prefix_batch() -> list[dict]:
    rng = random.Random(12)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone".split()
    templates = [
        "\n".join(f"Example {g}.{k}: " + " ".join(rng.choice(words) for _ in range(24)) for k in range(12))
        for g in range(GROUPS)
    ]
    rows = [(g, m) for g in range(GROUPS) for m in range(MEMBERS)]
    rng.shuffle(rows)
    return [
        {"custom_id": f"q-{i:03d}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": SERVED_NAME, "max_tokens": 2, "temperature": 0.0,
                  "messages": [{"role": "system", "content": templates[g]},
                               {"role": "user", "content": f"Question {m} about topic {g}?"}]}}
        for i, (g, m) in enumerate(rows)
    ]


def run(env: dict, server: VLLMServer, tmp_path: Path, grouping: str) -> tuple[list[dict], str]:
    requests = shared_prefix_batch()
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / f"out-{grouping}"
    proc = dags_test(env, {
        "input_uri": str(input_path), "output_uri": str(out), "endpoint": server.base_url,
        "model": SERVED_NAME, "requests_per_shard": 48, "concurrency": 4,
        "prefix_grouping": grouping,
    }, tmp_path / grouping)
    assert proc.returncode == 0, proc.stdout[-5000:]
    output = read_jsonl((out / "output.jsonl").read_text())
    assert (out / "errors.jsonl").read_text() == ""
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": len(requests), "completed": len(requests), "failed": 0}
    return output, proc.stdout


def cached_tokens(output: list[dict]) -> tuple[int, int]:
    usage = [r["response"]["body"]["usage"] for r in output]
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usage)
    return cached, sum(u["prompt_tokens"] for u in usage)


def test_grouping_keeps_input_order_and_multiplies_cache_hits(small_cache_server, airflow_session_env,
                                                              tmp_path):
    grouped, log = run(airflow_session_env, small_cache_server, tmp_path, "auto")
    assert "shards will hold whole groups" in log
    plain, log_off = run(airflow_session_env, small_cache_server, tmp_path, "off")
    assert "input order kept" in log_off
    cached_on, prompt_on = cached_tokens(grouped)
    cached_off, prompt_off = cached_tokens(plain)
    assert prompt_on == prompt_off
    template_tokens = prompt_on // (GROUPS * MEMBERS)
    assert template_tokens * GROUPS > 2 * KV_TOKENS  # the templates' KV is over twice the cache
    print(f"cached prompt tokens: grouping auto {cached_on} / off {cached_off} of {prompt_on}")
    # Grouped: all but the first few of each group hit their template.
    assert cached_on >= 0.6 * prompt_on
    assert cached_on >= 2 * cached_off
