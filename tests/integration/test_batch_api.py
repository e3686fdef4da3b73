"""The OpenAI-compatible Batch API, driven by the official ``openai`` SDK against a running
Airflow (api-server + scheduler + dag-processor + triggerer) and a real vLLM CPU server.

One Airflow deployment and one vLLM serve the whole module; tests use separate files and
batches, so their order does not matter.
"""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import openai
import pytest

from aibrix_operators.batch_api.airflow_runs import run_id_for
from aibrix_operators.batch_api.auth import key_digest
from aibrix_operators.batch_api.batches import API_CONF_KEY
from aibrix_operators.batch_api.tenant_salt import CLAIM_KEY, tenant_cache_salt
from aibrix_operators.local_airflow import AirflowDeployment, start_airflow, trigger_and_wait
from aibrix_operators.serving.local_vllm import free_port
from tests.fake_openai import FakeOpenAI
from tests.integration.conftest import PACED_MODEL, SERVED_NAME, chat_requests, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LOCAL_BUNDLE = "airflow.dag_processing.bundles.local.LocalDagBundle"
MAX_UPLOAD = 2 * 1024 * 1024
SALT_KEY = "salt-key-" + secrets.token_hex(16)
TERMINAL = ("completed", "failed", "expired", "cancelled")


class Api:
    def __init__(self, airflow: AirflowDeployment, keys: dict[str, str], root: Path) -> None:
        self.airflow = airflow
        self.keys = keys
        self.root = root
        self.base_url = airflow.api_url + "/openai/v1"

    def client(self, tenant: str = "alpha", key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key or self.keys[tenant], max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module")
def paced_stub() -> Iterator[FakeOpenAI]:
    """The deployment's second model: requests that take long without costing tokens (PACED_MODEL)."""
    with FakeOpenAI(model=PACED_MODEL).start() as server:
        yield server


@pytest.fixture(scope="module")
def api(airflow_session_env, vllm_chat, paced_stub, tmp_path_factory) -> Iterator[Api]:
    home = tmp_path_factory.mktemp("airflow-batch-api")
    root = tmp_path_factory.mktemp("batch-api-root")
    keys = {"alpha": "sk-alpha-" + secrets.token_hex(16), "beta": "sk-beta-" + secrets.token_hex(16)}
    port = free_port()
    env = {
        **airflow_session_env, "AIRFLOW_HOME": str(home),
        # Only digests are configured; the raw keys exist in this test alone.
        "AIRFLOW_VAR_AIBRIX_BATCH_API_KEYS": json.dumps({key_digest(k): t for t, k in keys.items()}),
        "AIRFLOW__AIBRIX_BATCH__API_STORAGE_ROOT": str(root),
        "AIRFLOW__AIBRIX_BATCH__API_MODELS":
            f"{SERVED_NAME}={vllm_chat.base_url}, {PACED_MODEL}={paced_stub.url}",
        "AIRFLOW__AIBRIX_BATCH__API_MAX_FILE_BYTES": str(MAX_UPLOAD),
        "AIRFLOW__AIBRIX_BATCH__API_DAG_CONF": json.dumps({"requests_per_shard": 200}),
        # The per-tenant cache_salt key (batch_api/tenant_salt.py), shared by the api-server's
        # workers as a deployment's would be.
        "AIRFLOW_VAR_AIBRIX_BATCH_CACHE_SALT_KEY": SALT_KEY,
        # A user's DAGs beside the pipeline's, as a second bundle (the operator's test): they
        # reach the Batch API through an aibrix_batch connection, as tenant beta.
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([
            {"name": "dags-folder", "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(REPO / "dags")}},
            {"name": "user-dags", "classpath": LOCAL_BUNDLE,
             "kwargs": {"path": str(REPO / "examples" / "dags")}},
            {"name": "test-dags", "classpath": LOCAL_BUNDLE,
             "kwargs": {"path": str(REPO / "tests" / "integration" / "user_dags")}},
        ]),
        "AIRFLOW_CONN_AIBRIX_BATCH_DEFAULT": json.dumps({
            "conn_type": "aibrix_batch", "host": f"http://127.0.0.1:{port}", "password": keys["beta"]}),
    }
    deployment = start_airflow(env, home, port)
    try:
        deployment.unpause("batch_inference")
        yield Api(deployment, keys, root)
    finally:
        deployment.stop()
    # No raw key anywhere the deployment wrote: component logs, task logs, the DB, outputs.
    for tree in (home, root):
        for path in tree.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                for key in keys.values():
                    assert key.encode() not in data, f"an API key leaked into {path}"


def upload(client: openai.OpenAI, records: list[dict], name: str = "input.jsonl") -> str:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = TERMINAL,
             timeout_s: float = 300) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout_s}s"
        time.sleep(1)


def content(client: openai.OpenAI, file_id: str) -> list[dict]:
    return read_jsonl(client.files.content(file_id).text)


def test_sdk_flow_end_to_end(api):
    client = api.client()
    requests = chat_requests(30)
    # One request the server rejects on its own (max_tokens beyond the context): an error line.
    requests[7]["body"]["max_tokens"] = 100_000
    file_id = upload(client, requests)
    assert client.files.retrieve(file_id).bytes > 0
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"team": "search"})
    assert batch.status == "validating" and batch.input_file_id == file_id
    assert batch.metadata == {"team": "search"}
    done = wait_for(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 30 and done.request_counts.completed == 29
    assert done.request_counts.failed == 1
    assert done.completed_at and done.in_progress_at and done.finalizing_at and done.expires_at
    assert done.usage and done.usage.input_tokens > 0
    output = content(client, done.output_file_id)
    errors = content(client, done.error_file_id)
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests if r is not requests[7]]
    assert [r["custom_id"] for r in errors] == ["req-0007"]
    assert all(r["response"]["status_code"] == 200 for r in output)
    # Output files are files of the tenant: listed, retrievable, purpose batch_output.
    listed = {f.id: f for f in client.files.list()}
    assert {file_id, done.output_file_id, done.error_file_id} <= set(listed)
    assert listed[done.output_file_id].purpose == "batch_output"
    # Cancelling a finished batch changes nothing.
    assert client.batches.cancel(batch.id).status == "completed"
    # Delete: gone afterwards.
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_tenants_share_no_prefix_cache(api):
    """Issue 19: tenants shared vLLM's prefix cache, so one could time another's prompts. Each
    tenant's requests now carry its own cache_salt: the same prompt is a hit within a tenant
    and never across tenants, even when a line names the other tenant's salt itself."""
    prompt = " ".join(secrets.token_hex(4) for _ in range(150))  # some 600 tokens, new to vLLM
    batches: list[tuple[str, str]] = []

    def cached_tokens(tenant: str, line_salt: str | None = None) -> int:
        body = {"model": SERVED_NAME, "max_tokens": 1, "temperature": 0.0,
                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        if line_salt is not None:
            body["cache_salt"] = line_salt
        client = api.client(tenant)
        line = {"custom_id": "probe", "method": "POST", "url": "/v1/chat/completions", "body": body}
        batch = client.batches.create(input_file_id=upload(client, [line]),
                                      endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1, done
        batches.append((tenant, batch.id))
        [out] = content(client, done.output_file_id)
        usage = out["response"]["body"]["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    assert cached_tokens("alpha") == 0
    assert cached_tokens("beta") == 0  # alpha's blocks are cached, under alpha's salt
    # Naming alpha's salt in a line does not join alpha's cache: it is kept under beta's.
    assert cached_tokens("beta", line_salt=tenant_cache_salt(SALT_KEY.encode(), "alpha")) == 0
    assert cached_tokens("alpha") > 0  # the owner's next batch hits
    assert cached_tokens("beta") > 0  # and beta's own

    # Someone who may read runs and trigger the DAG. Alpha's run shows a claim, never the salt.
    alpha_salt = tenant_cache_salt(SALT_KEY.encode(), "alpha")
    deployment, token = api.airflow, api.airflow.token()
    runs = deployment.api("GET", "/api/v2/dags/batch_inference/dagRuns?limit=100", token=token)["dag_runs"]
    assert all(alpha_salt not in json.dumps(r) for r in runs)
    # The run of alpha's last batch here (its input file still exists: other tests delete theirs).
    alpha_batch = [b for t, b in batches if t == "alpha"][-1]
    [conf] = [r["conf"] for r in runs if r["dag_run_id"] == run_id_for("alpha", alpha_batch)]
    assert set(conf[API_CONF_KEY][CLAIM_KEY]) == {"tenant", "tag"}
    # 1. Alpha's conf copied into a run of one's own: the claim verifies in no other run, so
    #    dispatch fails at once (no retry helps), sending nothing.
    copied = trigger_and_wait(deployment, "batch_inference",
                              {**conf, "output_uri": str(api.root / "replay-copied")}, timeout_s=300)
    assert copied["state"] == "failed", copied
    path = f"/api/v2/dags/batch_inference/dagRuns/{copied['dag_run_id']}/taskInstances"
    [dispatch] = [t for t in deployment.api("GET", path, token=token)["task_instances"]
                  if t["task_id"] == "dispatch"]
    assert dispatch["state"] == "failed" and dispatch["try_number"] == 1, dispatch
    log = deployment.api("GET", f"{path}/dispatch/logs/1?map_index={dispatch['map_index']}", token=token)
    assert "does not verify for run" in json.dumps(log), log
    # 2. Alpha's salt itself, learnt somehow, as the cache_salt param: sent as param:<salt>.
    named = {k: v for k, v in conf.items() if k != API_CONF_KEY}
    out = api.root / "replay-named"
    run = trigger_and_wait(deployment, "batch_inference",
                           {**named, "cache_salt": alpha_salt, "output_uri": str(out)}, timeout_s=300)
    assert run["state"] == "success", run
    [line] = read_jsonl((out / "output.jsonl").read_text())
    usage = line["response"]["body"]["usage"]
    assert ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) == 0


def test_list_pagination_newest_first(api):
    client = api.client("beta")
    file_id = upload(client, chat_requests(1))
    ids = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data][:1] == ids[:1]
    # The SDK's auto-pagination walks every page.
    assert [b.id for b in client.batches.list(limit=1)] [:3] == ids[::-1]
    files = client.files.list(limit=1)
    assert len(files.data) == 1 and files.data[0].id == file_id
    for batch_id in ids:
        wait_for(client, batch_id)


def test_cancel_mid_run(api):
    client = api.client()
    requests = chat_requests(800, max_tokens=48)
    batch = client.batches.create(input_file_id=upload(client, requests),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while True:  # live counts from the drivers' checkpoints
        current = client.batches.retrieve(batch.id)
        if current.status == "in_progress" and current.request_counts.completed > 0:
            break
        assert current.status in ("validating", "in_progress"), current
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert current.request_counts.total == 800
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_for(client, batch.id, timeout_s=120)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 800 and counts.completed + counts.failed == 800
    assert 0 < counts.completed < 800
    output = content(client, done.output_file_id)
    errors = content(client, done.error_file_id)
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {r["custom_id"] for r in output + errors} == {r["custom_id"] for r in requests}


def test_expiry_with_a_short_window(api):
    client = api.client()
    # ~3000 x 64 tokens takes this CPU server well over a minute; the window is 12 s.
    requests = chat_requests(3000, max_tokens=64)
    batch = client.batches.create(input_file_id=upload(client, requests),
                                  endpoint="/v1/chat/completions", completion_window="12s")
    assert batch.expires_at == batch.created_at + 12
    # One deadline (batch/deadline.py): the run's run_after is the batch's created_at, so the
    # deadline weights and the driver count from the second the API shows.
    run = api.airflow.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id_for('alpha', batch.id)}")
    assert datetime.fromisoformat(run["run_after"]).timestamp() == batch.created_at, run
    done = wait_for(client, batch.id, timeout_s=180)
    assert done.status == "expired" and done.expired_at
    assert done.expires_at == batch.expires_at and done.expired_at >= batch.expires_at
    counts = done.request_counts
    assert counts.total == 3000 and counts.completed + counts.failed == 3000 and counts.failed > 0
    errors = content(client, done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_validation_failure_has_line_numbers(api):
    client = api.client()
    good = json.dumps(chat_requests(1)[0])
    data = (good + "\n" + "{not json\n" + good.replace("req-0000", "req-0001") + "\n").encode()
    file_id = client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for(client, batch.id)
    assert done.status == "failed" and done.failed_at
    assert done.errors and done.errors.data
    assert (done.errors.data[0].code, done.errors.data[0].line) == ("invalid_json_line", 2)
    assert done.output_file_id is None


def test_request_rules(api):
    client = api.client()
    file_id = upload(client, chat_requests(1))
    create = dict(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for bad in ({"completion_window": "tomorrow"}, {"completion_window": "0h"},
                {"endpoint": "/v1/images/generations"},
                {"metadata": {f"k{i}": "v" for i in range(17)}},
                {"metadata": {"k" * 65: "v"}}, {"metadata": {"k": "v" * 513}}):
        with pytest.raises(openai.BadRequestError):
            client.batches.create(**{**create, **bad})
    other_model = upload(client, chat_requests(1, model="gpt-4o-mini"))
    with pytest.raises(openai.BadRequestError, match=SERVED_NAME):
        client.batches.create(**{**create, "input_file_id": other_model})
    with pytest.raises(openai.NotFoundError):
        client.batches.create(**{**create, "input_file_id": "file-" + "0" * 32})


def test_idempotent_create(api):
    client = api.client()
    file_id = upload(client, chat_requests(2))
    key = {"Idempotency-Key": "retry-" + secrets.token_hex(8)}
    first = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_headers=key)
    again = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_headers=key)
    assert again.id == first.id and again.created_at == first.created_at
    with pytest.raises(openai.ConflictError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="1h", extra_headers=key)
    # The same key from another tenant is that tenant's own, unrelated batch... of its own file.
    runs = api.airflow.api("GET", "/api/v2/dags/batch_inference/dagRuns?limit=1000")["dag_runs"]
    assert sum(r["dag_run_id"].endswith(first.id) for r in runs) == 1
    assert wait_for(client, first.id).status == "completed"


def test_tenant_isolation_and_auth(api):
    alpha, beta = api.client("alpha"), api.client("beta")
    file_id = upload(alpha, chat_requests(1))
    batch = alpha.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        beta.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        beta.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        beta.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # another tenant's file as input
        beta.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert file_id not in {f.id for f in beta.files.list()}
    assert batch.id not in {b.id for b in beta.batches.list()}
    for key in ("sk-wrong", api.keys["alpha"] + "x"):
        with pytest.raises(openai.AuthenticationError):
            api.client(key=key).files.list()
    req = urllib.request.Request(api.base_url + "/batches")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(req, timeout=30)
    assert missing.value.code == 401
    assert json.loads(missing.value.read())["error"]["code"] == "missing_api_key"
    # Ids and names that try to leave the tenant's prefix: 400 before any lookup.
    # (Raw HTTP: the SDK itself refuses '..' in a path.)
    for bad in ("..", "../beta/files/x", "file-%2e%2e", "%2Fetc%2Fpasswd", "file-" + "%EF%BC%90" * 32,
                "file-" + "0" * 31 + "%00"):
        for suffix in ("", "/content"):
            req = urllib.request.Request(f"{api.base_url}/files/{bad}{suffix}",
                                         headers={"Authorization": f"Bearer {api.keys['alpha']}"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=30)
            assert refused.value.code in (400, 404), bad
            assert set(json.loads(refused.value.read())["error"]) == {"message", "type", "param", "code"}
    # A newline in the path: Airflow's /openai mount cannot route it (found by schemathesis);
    # the path guard answers 400 in OpenAI's shape instead of Airflow's {"detail": "Not Found"}.
    for path in ("/batches/batch_%0A", "/files/file-a%0Ab/content", "/batches/x%0D%0A/cancel"):
        method = "POST" if path.endswith("/cancel") else "GET"
        req = urllib.request.Request(f"{api.base_url}{path}", method=method,
                                     headers={"Authorization": f"Bearer {api.keys['alpha']}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 400, path
        assert json.loads(refused.value.read())["error"]["code"] == "invalid_path", path
    for name in ("../x.jsonl", "/etc/passwd", "a\u202eb.jsonl", "e\u0301.jsonl", ".."):
        with pytest.raises(openai.BadRequestError):
            alpha.files.create(file=(name, io.BytesIO(b"{}\n")), purpose="batch")
    wait_for(alpha, batch.id)


def test_oversize_upload_is_413(api):
    client = api.client()
    line = json.dumps(chat_requests(1)[0]) + "\n"
    data = (line * (MAX_UPLOAD // len(line) + 10)).encode()
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert exc.value.status_code == 413
    # Nothing was published: no content object is left behind.
    assert not [p for p in (api.root / "tenants" / "alpha" / "files").glob("*.jsonl")
                if p.stat().st_size > MAX_UPLOAD]


def test_schemathesis_against_the_openapi_schema(api, tmp_path):
    """No 5xx, and every answer matches the app's own OpenAPI schema."""
    cmd = [str(Path(sys.executable).with_name("schemathesis")), "run",
           api.airflow.api_url + "/openai/openapi.json", "--url", api.airflow.api_url + "/openai",
           "-H", f"Authorization: Bearer {api.keys['beta']}",
           "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance,"
           "content_type_conformance", "--max-examples", "25", "--phases", "examples,fuzzing",
           "--report", "junit", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert api.keys["beta"] not in output and api.keys["alpha"] not in output


# The aibrix-batch CLI, BatchClient and monitor_url (issue 22) against this module's deployment:
# written in their own file, collected here so they share the one api-server and vLLM.
from tests.integration.batch_client_cases import (  # noqa: E402, F401
    test_a_finished_shards_answers_are_readable_while_the_batch_runs,
    test_cli_cancel_a_second_batch,
    test_cli_create_wait_status_list_results,
    test_cli_errors_are_one_line_with_their_exit_code,
    test_cli_pool_file_caps_the_batchs_running_shards,
    test_cli_pool_over_the_deployments_limit_is_refused_by_name,
    test_client_and_sdk_agree_on_one_batch,
    test_monitor_url_opens_the_run_in_the_airflow_ui,
)


def test_the_operator_in_a_user_dag_defers_and_hands_on_the_batch(api, tmp_path):
    """Issue 39: a user's DAG (examples/dags/batch_operator_example.py, its own bundle) runs
    AIBrixBatchOperator on the real scheduler and triggerer against this Batch API and vLLM: the
    task waits deferred (no worker slot), returns the batch through XCom, and its Asset's event
    carries the batch to the DAG scheduled on it."""
    requests = chat_requests(40)
    input_file = write_jsonl(tmp_path / "input.jsonl", requests)
    deployment, token = api.airflow, api.airflow.token()
    deployment.unpause("batch_operator_example", "batch_operator_example_scores", token=token)
    run = deployment.api("POST", "/api/v2/dags/batch_operator_example/dagRuns", {
        "logical_date": None, "conf": {"input_file": str(input_file), "model": SERVED_NAME}}, token)
    ti_path = f"/api/v2/dags/batch_operator_example/dagRuns/{run['dag_run_id']}/taskInstances/answer"
    states: set[str] = set()
    deadline = time.monotonic() + 300
    while run["state"] not in ("success", "failed"):
        assert time.monotonic() < deadline, f"run still {run['state']}; answer was {states}"
        try:
            states.add(deployment.api("GET", ti_path, token=token)["state"])
        except AssertionError:
            pass  # not created yet
        time.sleep(0.5)
        run = deployment.api("GET", f"/api/v2/dags/batch_operator_example/dagRuns/{run['dag_run_id']}",
                             token=token)
    assert run["state"] == "success", deployment.failure_report("batch_operator_example", run["dag_run_id"])
    assert "deferred" in states, states  # it waited in the triggerer, not in a worker slot
    ti = deployment.api("GET", ti_path, token=token)
    assert ti["try_number"] == 1, ti

    xcom = deployment.api("GET", f"{ti_path}/xcomEntries/return_value?deserialize=true&stringify=false",
                          token=token)
    result = json.loads(xcom["value"]) if isinstance(xcom["value"], str) else xcom["value"]
    client = api.client("beta")
    batch = client.batches.retrieve(result["batch_id"])
    assert batch.status == "completed" and result["status"] == "completed"
    assert result["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    output = content(client, result["output_file_id"])
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    key = batch.metadata["airflow_task_key"]
    listed = client.batches.list(limit=100)
    keyed = [b.id for b in listed if (b.metadata or {}).get("airflow_task_key") == key]
    assert keyed == [batch.id]  # one batch for the task

    # The Asset's event carries the batch, and the DAG scheduled on the Asset ran on it.
    events = deployment.api("GET", "/api/v2/assets/events?source_dag_id=batch_operator_example",
                            token=token)["asset_events"]
    [event] = [e for e in events if e["source_run_id"] == run["dag_run_id"]]
    assert event["extra"]["batch_id"] == batch.id and event["extra"]["request_counts"]["completed"] == 40
    deadline = time.monotonic() + 120
    while True:
        runs = deployment.api("GET", "/api/v2/dags/batch_operator_example_scores/dagRuns",
                              token=token)["dag_runs"]
        if any(r["state"] == "success" for r in runs):
            break
        assert time.monotonic() < deadline and not any(r["state"] == "failed" for r in runs), runs
        time.sleep(1)
    [scored] = [r for r in runs if r["state"] == "success"]
    assert scored["run_type"] == "asset_triggered", scored


def test_the_operator_re_attaches_after_its_worker_is_lost(api, tmp_path):
    """Issue 39: the worker running AIBrixBatchOperator (polling in the worker:
    tests/integration/user_dags/batch_operator_in_worker.py) is killed mid-batch, task process
    and all, as a lost node would lose it. The scheduler finds the task without a heartbeat and
    retries it; the retry re-attaches to the batch the first try submitted (the API saw one
    create) and hands it on."""
    import psutil

    requests = chat_requests(40, max_tokens=32)
    input_file = write_jsonl(tmp_path / "input.jsonl", requests)
    deployment, token = api.airflow, api.airflow.token()
    deployment.unpause("batch_operator_in_worker", token=token)
    run = deployment.api("POST", "/api/v2/dags/batch_operator_in_worker/dagRuns", {
        "logical_date": None, "conf": {"input_file": str(input_file), "model": SERVED_NAME}}, token)
    run_path = f"/api/v2/dags/batch_operator_in_worker/dagRuns/{run['dag_run_id']}"
    ti_path = f"{run_path}/taskInstances/answer"

    def submitted() -> tuple[dict, str] | None:
        """The running first try and the batch it submitted, once both are known."""
        try:
            ti = deployment.api("GET", ti_path, token=token)
            xcom = deployment.api("GET", f"{ti_path}/xcomEntries/batch_id?deserialize=true&stringify=false",
                                  token=token)
        except AssertionError:
            return None  # not created or not pushed yet
        assert ti["state"] in ("queued", "running"), ti  # the batch must still be running
        return (ti, xcom["value"]) if ti["state"] == "running" and ti["pid"] else None

    deadline = time.monotonic() + 120
    while (found := submitted()) is None:
        assert time.monotonic() < deadline, "the operator never submitted its batch"
        time.sleep(0.3)
    ti, batch_id = found
    client = api.client("beta")
    assert client.batches.retrieve(batch_id).status not in TERMINAL  # killed mid-batch

    # The worker: the task process's supervisor, one of the scheduler's LocalExecutor workers.
    task = psutil.Process(ti["pid"])
    worker = task.parent()
    scheduler = psutil.Process(deployment.procs[1].pid)
    assert worker.pid in {p.pid for p in scheduler.children(recursive=True)}, worker
    victims = [worker, *worker.children(recursive=True)]
    for proc in victims:
        proc.kill()
    psutil.wait_procs(victims, timeout=30)

    deadline = time.monotonic() + 300
    while (run := deployment.api("GET", run_path, token=token))["state"] not in ("success", "failed"):
        assert time.monotonic() < deadline, f"run still {run['state']}"
        time.sleep(1)
    assert run["state"] == "success", deployment.failure_report("batch_operator_in_worker", run["dag_run_id"])
    ti = deployment.api("GET", ti_path, token=token)
    assert ti["try_number"] == 2, ti  # the lost try, then the one that re-attached

    xcom = deployment.api("GET", f"{ti_path}/xcomEntries/return_value?deserialize=true&stringify=false",
                          token=token)
    result = json.loads(xcom["value"]) if isinstance(xcom["value"], str) else xcom["value"]
    assert result["batch_id"] == batch_id, (result["batch_id"], batch_id)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed" and result["request_counts"]["completed"] == 40
    key = batch.metadata["airflow_task_key"]
    listed = client.batches.list(limit=100)
    keyed = [b.id for b in listed if (b.metadata or {}).get("airflow_task_key") == key]
    assert keyed == [batch_id]  # one create: the retry re-attached
    output = content(client, result["output_file_id"])
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
