"""The dry run (issue 40.3): ``aibrix-batch create --dry-run`` / ``BatchClient.dry_run`` check the
file, count its work and ask the Batch API (``POST /v1/batches/estimate``) when it would be done and
what it would cost at the deployment's measured rate. Nothing is uploaded, created or sent. The app
is the real FastAPI app, served in-process (Starlette's TestClient as the SDK's HTTP client)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from aibrix_operators.batch.admission import Rate, endpoint_key, learn_rate
from aibrix_operators.batch.cost import Prices
from aibrix_operators.batch_api.app import ApiContext, create_app
from aibrix_operators.batch_api.auth import key_digest
from aibrix_operators.batch_api.settings import ApiSettings, ModelRoute
from aibrix_operators.client.batch_client import BatchClient
from aibrix_operators.client.cli import describe_dry_run
from aibrix_operators.client.errors import InputFileError
from aibrix_operators.storage import LocalStorage

KEY = "sk-dry-run-test"
ENDPOINT = "http://127.0.0.1:8000"


@pytest.fixture
def api(tmp_path: Path):
    storage = LocalStorage()
    settings = ApiSettings(storage_root=str(tmp_path / "api"), models={"m": ModelRoute(endpoint=ENDPOINT)},
                           state_root=str(tmp_path / "state"), min_window_s=60,
                           prices=Prices(input=1.0, output=2.0))
    context = ApiContext(settings, storage, lambda: {key_digest(KEY): "team-a"}, state=storage)
    app = create_app(lambda: context)
    with TestClient(app) as http:
        yield BatchClient("http://testserver/v1", KEY, http_client=http), settings, context


def _file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]},
    }) + "\n" for i in range(n)))
    return path


def test_a_dry_run_counts_the_work_and_sends_nothing(api, tmp_path: Path) -> None:
    client, settings, context = api
    path = _file(tmp_path, 50)
    first = client.dry_run(path, completion_window="1h")
    assert first["work"] == {"requests": 50, "input_bytes": path.stat().st_size, "max_output_tokens": 1000,
                             "unbounded_requests": 0}
    assert "no measurement yet" in first["estimate"]["basis"] and first["cost"] is None
    # Once a batch has run there: at 10 tokens/s, 0.25 tokens a byte, the file's tokens and cost.
    learn_rate(context.state, settings.state_root, Rate(endpoint_key("m", ENDPOINT), 10.0, 0.25, 10.0))
    answer = client.dry_run(path, completion_window="1h")
    input_tokens = round(path.stat().st_size * 0.25)
    assert (answer["estimate"]["input_tokens"], answer["estimate"]["output_tokens"]) == (input_tokens, 1000)
    seconds = (input_tokens + 1000) / 10
    assert answer["estimate"]["seconds"] == pytest.approx(seconds, abs=0.1) and 120 < seconds < 3600
    assert answer["estimate"]["feasible"] is True
    assert answer["cost"]["total"] == pytest.approx((input_tokens * 1.0 + 1000 * 2.0) / 1e6, abs=1e-6)
    text = describe_dry_run(answer)
    assert text.startswith("dry run: nothing uploaded or sent") and "at most 1000 tokens" in text
    # A window the rate cannot meet says so, with the shortest that would be met.
    tight = client.dry_run(path, completion_window="2m")
    assert tight["estimate"]["feasible"] is False
    assert tight["estimate"]["earliest_window"] == f"{-(-int(seconds + 1) // 60)}m"
    # Nothing was uploaded, queued or created.
    assert not (tmp_path / "api").exists() or not any((tmp_path / "api").rglob("*.json"))
    assert not (tmp_path / "state" / "queue").exists()


def test_a_bad_file_is_refused_before_anything_is_asked(api, tmp_path: Path) -> None:
    client, _, _ = api
    path = tmp_path / "bad.jsonl"
    path.write_text('{"custom_id": "a", "method": "POST"}\n')
    with pytest.raises(InputFileError, match="nothing was uploaded"):
        client.dry_run(path)
