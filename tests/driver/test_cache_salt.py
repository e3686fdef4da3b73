"""The batch's cache_salt on the wire (issue 19: tenants shared vLLM's prefix cache).

The driver sends to the fake OpenAI server (tests/fake_openai.py), which records every body; the
salt is added to every request whose endpoint takes one, a line's own salt is kept under the
batch's, and without a salt the bytes sent are the line's own. The cross-tenant effect on a real vLLM is
tests/integration/test_batch_api.py::test_tenants_share_no_prefix_cache."""

from __future__ import annotations

import pytest

from aibrix_operators.batch_api.tenant_salt import load_cache_salt_key, tenant_cache_salt
from aibrix_operators.driver.cli import build_parser, config_from
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage
from tests.driver.test_driver_faults import results_by_id, write_shard
from tests.fake_openai import FakeOpenAI


@pytest.fixture
async def server():
    server = await FakeOpenAI().astart()
    yield server
    await server.aclose()


def by_marker(server: FakeOpenAI) -> dict[str, dict]:
    """The body's marker field -> the body the server received."""
    return {body["marker"]: body for _, body in server.received}


def line(marker: str, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": marker, "method": "POST", "url": url,
            "body": {"model": "m", "marker": marker, "messages": [], **body}}  # fmt: skip


LINES = [
    line("plain"),
    line("own", cache_salt="mine"),
    line("completion", url="/v1/completions"),
    line("embedding", url="/v1/embeddings"),
    line("not-a-string", cache_salt=7),
    line("responses", url="/v1/responses"),
    line("score", url="/v1/score"),
    line("rerank", url="/v1/rerank", cache_salt="mine"),
]


async def _send(url: str, tmp_path, salt: str | None) -> None:
    storage, shard = LocalStorage(), write_shard(tmp_path, LINES)
    cfg = DriverConfig(url, concurrency=2, flush_interval_s=0.05, api_key_env=None, cache_salt=salt)
    await run_shard(storage, shard, str(tmp_path / "results"), cfg)
    assert sorted(results_by_id(storage, str(tmp_path / "results"), shard)) == sorted(
        r["custom_id"] for r in LINES
    )


async def test_the_batch_salt_is_on_every_generation_request(server, tmp_path) -> None:
    await _send(server.url, tmp_path, "tenant-abc")
    salts = {marker: body.get("cache_salt", "<none>") for marker, body in by_marker(server).items()}
    assert salts == {
        "plain": "tenant-abc",
        "own": "tenant-abc:mine",  # kept under the batch's: a line cannot name another tenant's
        "completion": "tenant-abc",
        # vLLM 0.32's pooling requests take cache_salt too (PoolingBasicRequestMixin)
        "embedding": "tenant-abc",
        "not-a-string": 7,  # left for vLLM to refuse as the line's own error
        "responses": "tenant-abc",
        "score": "tenant-abc",
        "rerank": "tenant-abc:mine",
    }


async def test_without_a_salt_a_lines_own_is_namespaced(server, tmp_path) -> None:
    # A direct trigger with no batch salt cannot send a bare salt of the Batch API's form.
    await _send(server.url, tmp_path, None)
    assert {m: b.get("cache_salt") for m, b in by_marker(server).items()} == {
        "plain": None, "own": "line:mine", "completion": None, "embedding": None, "not-a-string": 7,
        "responses": None, "score": None, "rerank": "line:mine",
    }  # fmt: skip


def test_the_cli_takes_the_salt_and_refuses_a_bad_one() -> None:
    base = ["--shard-uri", "s", "--results-prefix", "r", "--endpoint", "http://127.0.0.1:1"]
    assert config_from(build_parser().parse_args([*base, "--cache-salt", "t-1"])).cache_salt == "t-1"
    assert config_from(build_parser().parse_args(base)).cache_salt is None
    with pytest.raises(ValueError, match="cache_salt"):
        config_from(build_parser().parse_args([*base, "--cache-salt", "x" * 129]))
    with pytest.raises(ValueError, match="cache_salt"):
        config_from(build_parser().parse_args([*base, "--cache-salt", "a\nb"]))
    # The pod spec's one-token form takes a salt that starts with "-".
    assert config_from(build_parser().parse_args([*base, "--cache-salt=-x"])).cache_salt == "-x"


def test_tenant_salts_are_stable_distinct_and_keyed() -> None:
    key = b"k" * 32
    assert tenant_cache_salt(key, "alpha") == tenant_cache_salt(key, "alpha")
    assert tenant_cache_salt(key, "alpha") != tenant_cache_salt(key, "beta")
    assert tenant_cache_salt(key, "alpha") != tenant_cache_salt(b"j" * 32, "alpha")  # unguessable
    assert "alpha" not in tenant_cache_salt(key, "alpha")


def test_the_salt_key_comes_from_the_variable_or_is_stored_there(caplog) -> None:
    def never(_: str) -> None:
        pytest.fail("the Variable was written although it is set")

    assert load_cache_salt_key(None, lambda: "from-variable", never) == b"from-variable"
    assert load_cache_salt_key("off", lambda: "from-variable", never) is None
    # Unset: a random key is stored in the Variable, where the workers read it to verify claims.
    stores: list[dict[str, str]] = [{}, {}]
    one, two = (
        load_cache_salt_key("per-tenant", lambda s=s: s.get("v"), lambda v, s=s: s.update(v=v))
        for s in stores
    )
    assert one != two and one == stores[0]["v"].encode() and len(one) == 64  # never a fixed fallback
    assert "aibrix_batch_cache_salt_key is not set" in caplog.text

    def unreadable() -> str:
        raise RuntimeError("secrets backend down")

    # Unreadable: an error, not a key of this process that no worker could verify claims with.
    with pytest.raises(RuntimeError, match="secrets backend down"):
        load_cache_salt_key(None, unreadable, never)
    with pytest.raises(ValueError, match="api_cache_salt"):
        load_cache_salt_key("shared", lambda: None, never)
