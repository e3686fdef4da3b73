"""The Batch API's request rules as OpenAI states them, against the app in-process (issue 24):
job-pool memory that is no number, a completion_window under the deployment's minimum, metadata
past OpenAI's limits, the in-progress status line beside (not inside) the client's metadata,
and query errors answered 400 in OpenAI's shape, never FastAPI's 422.

The DAG runs are the only thing not real here: ``FakeRuns`` stands in for Airflow's DAG-run
table (``BatchRuns``), keeping each triggered run's conf as the real one would."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from aibrix_operators.batch.lifecycle import RunSnapshot, TaskState
from aibrix_operators.batch_api.airflow_runs import RunRow
from aibrix_operators.batch_api.app import ApiContext, create_app
from aibrix_operators.batch_api.auth import key_digest
from aibrix_operators.batch_api.settings import ApiSettings, load_settings
from aibrix_operators.storage import LocalStorage

KEY = "sk-openai-rules"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


@dataclass
class FakeRuns:
    """Airflow's DAG runs as the API sees them: ``trigger`` keeps the conf; ``snapshots`` shows
    every run in progress (validated a minute ago, a quarter of its requests answered)."""

    runs: dict[str, RunRow] = field(default_factory=dict)

    def trigger(self, run_id: str, conf: dict[str, Any], created_at: int) -> tuple[RunRow, bool]:
        if run_id in self.runs:
            return self.runs[run_id], False
        # Airflow stores the conf as JSON: what comes back is what survives a round trip.
        row = RunRow(run_id, run_id.rsplit("__", 1)[-1], "running", json.loads(json.dumps(conf)))
        self.runs[run_id] = row
        return row, True

    def get(self, run_id: str) -> RunRow | None:
        return self.runs.get(run_id)

    def list(self, tenant: str, after_run_id: str | None, limit: int) -> list[RunRow]:
        assert after_run_id is None
        return [r for r in reversed(self.runs.values()) if r.run_id.startswith(f"openai__{tenant}__")][:limit]

    def snapshots(self, rows: list[RunRow]) -> list[RunSnapshot]:
        out = []
        for row in rows:
            now = int(time.time())
            snap = RunSnapshot(row.batch_id, row.conf, "running", {
                "validate": [TaskState("success", now - 70, now - 60)],
                "dispatch": [TaskState("running", now - 60, None)]})
            snap.live_counts = (1000, 250, 0)
            out.append(snap)
        return out


def _app(tmp_path, settings: ApiSettings | None = None):
    settings = settings or ApiSettings(storage_root=str(tmp_path / "api"),
                                       models=load_settings({"api_models": f"{MODEL}=http://127.0.0.1:1"}.get,
                                                            tmp_path).models)
    runs = FakeRuns()

    def context() -> ApiContext:
        ctx = ApiContext(settings, LocalStorage(), lambda: {key_digest(KEY): "alpha"})
        ctx.runs = runs  # type: ignore[assignment]
        return ctx

    app = create_app(context)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api"), runs


async def _upload(client: httpx.AsyncClient) -> str:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
    resp = await client.post("/v1/files", headers=AUTH, data={"purpose": "batch"},
                             files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")})
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _create(file_id: str, **extra: Any) -> dict[str, Any]:
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}


def _openai_400(resp: httpx.Response, param: str) -> dict[str, Any]:
    """The body of an OpenAI 400: every field of OpenAI's error object, the param named."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"], error
    return error


# ---------------------------------------------------------------------- 1. memory_per_job
async def test_a_memory_per_job_of_400_digits_is_a_400_naming_the_key_and_the_limit(tmp_path):
    client, runs = _app(tmp_path)
    file_id = await _upload(client)
    resp = await client.post("/v1/batches", headers=AUTH,
                             json=_create(file_id, pool={"memory_per_job": "9" * 400}))
    error = _openai_400(resp, "pool")  # was a 500: OverflowError in int(float(num) * unit)
    assert error["code"] == "invalid_job_pool"
    assert "memory_per_job" in error["message"] and "at most 24 characters" in error["message"]
    for bad in ("٢Gi", "2.5.1Gi", "1e400"):  # other digits, other shapes: 400 too, never 500
        resp = await client.post("/v1/batches", headers=AUTH,
                                 json=_create(file_id, pool={"memory_per_job": bad}))
        assert "memory_per_job" in _openai_400(resp, "pool")["message"]
    # Long digits that fit: read exactly, then refused by the deployment's limit, by its name.
    resp = await client.post("/v1/batches", headers=AUTH,
                             json=_create(file_id, pool={"memory_per_job": "9" * 24}))
    assert "pool_max_memory_per_job" in _openai_400(resp, "pool")["message"]
    assert runs.runs == {}


# ---------------------------------------------------------------------- 2. completion_window floor
async def test_a_window_under_the_deployments_minimum_is_a_400_saying_the_minimum(tmp_path):
    client, runs = _app(tmp_path)
    file_id = await _upload(client)
    for window in ("1s", "59m", "3599s"):
        resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, completion_window=window))
        error = _openai_400(resp, "completion_window")
        assert error["code"] == "invalid_completion_window"
        assert "minimum of 1h ([aibrix_batch] min_completion_window)" in error["message"]
        assert "at least 1h" in error["message"]
    for window in ("١h", "２4h", "1" * 12 + "s"):  # digits of other scripts; absurd lengths
        resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, completion_window=window))
        assert _openai_400(resp, "completion_window")["code"] == "invalid_completion_window"
    assert runs.runs == {}
    resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, completion_window="1h"))
    assert resp.status_code == 200, resp.text  # at the minimum: accepted


async def test_the_minimum_is_the_deployments_setting(tmp_path):
    config = {"api_models": f"{MODEL}=http://127.0.0.1:1", "min_completion_window": "10s"}
    settings = load_settings(config.get, tmp_path / "api")
    assert settings.min_window_s == 10
    client, _ = _app(tmp_path, settings)
    file_id = await _upload(client)
    resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, completion_window="12s"))
    assert resp.status_code == 200, resp.text
    resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, completion_window="9s"))
    assert "minimum of 10s" in _openai_400(resp, "completion_window")["message"]
    with pytest.raises(ValueError, match=r"\[aibrix_batch\] min_completion_window = 'soon'"):
        load_settings({"min_completion_window": "soon"}.get, tmp_path)


# ---------------------------------------------------------------------- 3. metadata limits
@pytest.mark.parametrize("metadata, says", [
    ({f"k{i}": "v" for i in range(17)}, "at most 16 pairs"),
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"k": "v" * 513}, "at most 512 characters"),
    ({"k": 1}, "must be strings"),
    ({"k": None}, "must be strings"),
    ({"k": {"nested": "v"}}, "must be strings"),
    ({"": "v"}, "non-empty"),
    ({"k\n": "v"}, "control or invisible"),
    ({"\x00": "v"}, "control or invisible"),
    ({"a\u200bb": "v"}, "control or invisible"),  # zero-width space: looks like "ab"
    ({"k": "\ud800"}, "unpaired surrogate"),
    (["k", "v"], "valid dictionary"),
])
async def test_metadata_past_openais_limits_is_a_400(tmp_path, metadata, says):
    client, runs = _app(tmp_path)
    file_id = await _upload(client)
    body = json.dumps(_create(file_id, metadata=metadata))  # "\ud800" goes as the JSON escape
    json_type = {**AUTH, "Content-Type": "application/json"}
    resp = await client.post("/v1/batches", headers=json_type, content=body)
    error = _openai_400(resp, "metadata")
    assert says in error["message"], error
    assert runs.runs == {}


# ---------------------------------------------------------------------- 4. metadata stays the client's
async def test_a_batch_created_with_16_pairs_comes_back_with_those_16_and_its_status_beside_them(tmp_path):
    client, runs = _app(tmp_path)
    file_id = await _upload(client)
    metadata = {f"key-{i:02d}": "ü" * 512 if i == 0 else f"value {i}" for i in range(15)}
    metadata["k" * 64] = "at the key limit"
    resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, metadata=metadata))
    assert resp.status_code == 200, resp.text
    batch_id = resp.json()["id"]
    for got in (resp.json(), (await client.get(f"/v1/batches/{batch_id}", headers=AUTH)).json(),
                (await client.get("/v1/batches", headers=AUTH)).json()["data"][0]):
        assert got["status"] == "in_progress"
        assert got["metadata"] == metadata  # 16 pairs, as sent: no aibrix_status among them
        assert got["aibrix_status"].startswith("on track: 750 requests left")
        # The official SDK reads it: metadata as sent, the status line an extra field.
        batch = openai.types.Batch.model_validate(got)
        assert batch.metadata == metadata and len(batch.metadata) == 16
        assert batch.aibrix_status == got["aibrix_status"] == batch.model_extra["aibrix_status"]
    # The run's conf (what the DAG gets and batch.json keeps) holds the same 16.
    [row] = runs.runs.values()
    assert row.conf["metadata"] == metadata


# ---------------------------------------------------------------------- 5. query errors are OpenAI 400s
@pytest.mark.parametrize("url, param", [
    ("/v1/files?limit=0", "limit"), ("/v1/batches?limit=0", "limit"), ("/v1/batches?limit=101", "limit"),
    ("/v1/files?limit=10001", "limit"), ("/v1/batches?limit=many", "limit"), ("/v1/files?order=up", "order"),
    ("/v1/files?after=" + "x" * 101, "after"),
])
async def test_query_errors_are_openai_400s_not_422(tmp_path, url, param):
    client, _ = _app(tmp_path)
    error = _openai_400(await client.get(url, headers=AUTH), param)
    assert error["message"].startswith(f"Invalid '{param}': ")


async def test_body_errors_are_openai_400s_and_the_schema_documents_no_422(tmp_path):
    client, _ = _app(tmp_path)
    file_id = await _upload(client)
    json_type = {**AUTH, "Content-Type": "application/json"}
    error = _openai_400(await client.post("/v1/batches", headers=json_type, content=b"{nope"), None)
    assert error["code"] == "invalid_json"
    resp = await client.post("/v1/batches", headers=AUTH, json={"endpoint": "/v1/chat/completions"})
    assert _openai_400(resp, "input_file_id")["code"] == "missing_required_parameter"
    resp = await client.post("/v1/batches", headers=AUTH, json=_create(file_id, completion_window=24))
    assert _openai_400(resp, "completion_window")["code"] == "invalid_type"
    schema = (await client.get("/openapi.json")).json()
    documented = {code for ops in schema["paths"].values() for op in ops.values() for code in op["responses"]}
    assert "422" not in documented and "400" in documented
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})
