"""Endpoint trust against real HTTP servers (issue 19, findings 1-3): a path prefix cannot be
escaped, a redirect is never followed, and the deployment's key goes only to its base URL.

Each attack is made for real: the driver sends to aiohttp servers that record every path and
header they receive, and the tests assert both that the attack fails and that the legitimate
request next to it still goes through."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage
from aibrix_operators.trust.deployment import resolve_inference
from aibrix_operators.trust.policy import TrustPolicy, TrustViolation, endpoint_form_problem, under_base
from tests.driver.test_driver_faults import results_by_id, write_shard

MESSAGE = {"role": "assistant", "content": "ok"}
ANSWER = {"id": "c", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": MESSAGE, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip


class Recorder:
    """An OpenAI-compatible server that records (method, path, Authorization) of every request."""

    def __init__(self, redirect_to: str | None = None) -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        self.redirect_to = redirect_to
        self.server: TestServer | None = None

    async def start(self) -> Recorder:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def _any(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append((request.method, request.raw_path, request.headers.get("Authorization")))
        if self.redirect_to and request.method == "POST":
            raise web.HTTPTemporaryRedirect(self.redirect_to + request.raw_path)
        if request.path.endswith("/models"):
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
        return web.json_response(ANSWER)


@pytest.fixture
async def recorder():
    made: list[Recorder] = []

    async def make(**kw) -> Recorder:
        made.append(await Recorder(**kw).start())
        return made[-1]

    yield make
    for r in made:
        assert r.server is not None
        await r.server.close()


def posts(recorder: Recorder) -> list[tuple[str, str | None]]:
    """The requests' (path, Authorization); the driver's GETs of the endpoint's ``/metrics`` (its
    token counters, driver/engine_time.py) are checked on their own by ``scrapes``."""
    return [(path, auth) for method, path, auth in recorder.seen if method == "POST"]


def scrapes(recorder: Recorder) -> list[tuple[str, str | None]]:
    return [(path, auth) for method, path, auth in recorder.seen if method == "GET"]


def chat(cid: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip


def config(endpoint: str, **kw) -> DriverConfig:
    return DriverConfig(endpoint, concurrency=2, max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.05,
                        flush_interval_s=0.05, api_key_env=None, **kw)  # fmt: skip


ESCAPES = ["/team-a/../admin", "/team-a/%2e%2e/admin", "/team-a/%2E%2E/admin", "/team-a/./../admin",
           "/team-a/..%2fadmin", "/team-a\\..\\admin", "/team-a//../admin", "/team-a/\t../admin",
           "/team-a?x=", "/team-a#frag", "/team-a/ ../admin",
           # Found by a second review: '..;' is '..' to Tomcat, Jetty, Spring and gateways built on
           # them; non-ASCII is percent-encoded by the client, so what was checked is not sent.
           "/team-a/..;/admin", "/team-a;/../admin", "/team-a/\uff0e\uff0e/admin", "/team-a/\u200b../admin",
           "/team-a/\u00a0/admin", "/t\u0435am-a/admin"]  # fmt: skip


@pytest.mark.parametrize("escape", ESCAPES)
async def test_a_path_prefix_cannot_be_escaped(recorder, escape, tmp_path):
    server = await recorder()
    policy = TrustPolicy(endpoints=(f"{server.url}/team-a",), storage=(), aws_conn_ids=(),
                         inference_conn_ids=())  # fmt: skip
    with pytest.raises(TrustViolation, match="allowed_endpoints"):
        policy.check_endpoint(server.url + escape)
    with pytest.raises(ValueError):  # the driver refuses it too, whoever built its config
        config(server.url + escape)
    # The legitimate endpoint under the same prefix is allowed and receives exactly its path.
    policy.check_endpoint(f"{server.url}/team-a")
    storage, shard = LocalStorage(), write_shard(tmp_path, [chat("ok")])
    await run_shard(storage, shard, str(tmp_path / "results"), config(f"{server.url}/team-a"))
    assert [path for path, _ in posts(server)] == ["/team-a/v1/chat/completions"]
    assert {path for path, _ in scrapes(server)} == {"/team-a/metrics"}  # under the prefix too
    assert results_by_id(storage, str(tmp_path / "results"), shard)["ok"]["error"] is None


async def test_a_redirect_is_never_followed(recorder, tmp_path, caplog):
    elsewhere = await recorder()  # not on the allow-list: must receive nothing
    allowed = await recorder(redirect_to=elsewhere.url)
    storage, shard = LocalStorage(), write_shard(tmp_path, [chat(f"r{i}") for i in range(5)])
    cfg = config(allowed.url, api_key="sk-bound", api_key_origin=allowed.url)
    await run_shard(storage, shard, str(tmp_path / "results"), cfg)
    assert elsewhere.seen == []  # neither the bodies nor the key went there
    records = results_by_id(storage, str(tmp_path / "results"), shard)
    assert sorted(records) == [f"r{i}" for i in range(5)]  # every request answered once
    for record in records.values():
        assert record["error"]["code"] == "endpoint_redirected", record
        message = record["error"]["message"]
        # Where it pointed is in the task log, not in the line a (Batch API) submitter reads.
        assert "redirects are not followed" in message and "127.0.0.1" not in message
    assert elsewhere.url in caplog.text
    assert len(posts(allowed)) == 5 and {p for p, _ in scrapes(allowed)} == {"/metrics"}


async def test_the_key_goes_only_to_its_base_url(recorder, tmp_path):
    server = await recorder()
    bound = {"api_key": "sk-team-a", "api_key_origin": f"{server.url}/team-a"}
    storage = LocalStorage()
    for i, endpoint in enumerate([f"{server.url}/team-a", f"{server.url}/team-b", server.url]):
        shard = write_shard(tmp_path / str(i), [chat(f"k{i}")])
        await run_shard(storage, shard, str(tmp_path / str(i) / "results"), config(endpoint, **bound))
    assert posts(server) == [
        ("/team-a/v1/chat/completions", "Bearer sk-team-a"),
        ("/team-b/v1/chat/completions", None),  # same origin, another base path: no key
        ("/v1/chat/completions", None),
    ]
    # The scrapes of each endpoint's counters (before and after sending) follow the same rule.
    assert scrapes(server) == ([("/team-a/metrics", "Bearer sk-team-a")] * 2 + [("/team-b/metrics", None)] * 2
                               + [("/metrics", None)] * 2)
    # A query or fragment cannot swallow the request path to reach another route with the key.
    for smuggle in ("/team-a?x=", "/team-a#", "/team-a/..%2fv1/load_lora_adapter?x="):
        with pytest.raises(ValueError):
            config(server.url + smuggle, **bound)
        assert not under_base(server.url + smuggle, f"{server.url}/team-a")


def test_an_inference_connection_binds_its_key_to_origin_and_base_path(monkeypatch):
    conn = {"conn_type": "http", "host": "http://127.0.0.1:9/team-a", "password": "sk-conn"}
    monkeypatch.setenv("AIRFLOW_CONN_TRUST_TEST", json.dumps(conn))
    policy = TrustPolicy(endpoints=(), storage=(), aws_conn_ids=(), inference_conn_ids=("trust_test",))
    target = resolve_inference(policy, None, "trust_test")
    assert target.endpoint == target.api_key_origin == "http://127.0.0.1:9/team-a"
    assert resolve_inference(policy, "http://127.0.0.1:9/team-a/v1", "trust_test").api_key == "sk-conn"
    for foreign in ("http://127.0.0.1:9/team-b", "http://127.0.0.1:9/team-a?x=", "http://127.0.0.1:9/team-a#",
                    "http://127.0.0.1:9/team-a/../admin", "http://127.0.0.1:9"):
        with pytest.raises(TrustViolation, match="inference_conn_id"):
            resolve_inference(policy, foreign, "trust_test")


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/v1", "https://h/team-a/v1/", "http://[::1]:8000/x_y-z"])
def test_plain_base_urls_are_accepted(url):
    assert endpoint_form_problem(url) is None
