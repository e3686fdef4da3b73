"""Loading an adapter on a server (lora/serving.py) against a real aiohttp server that answers
like vLLM's runtime LoRA routes: skipped when the server already serves the folder, replaced in
place when it serves another, a race with another shard's load, a server without runtime
loading, and one that does not answer."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from aibrix_operators.lora.registry import Adapter
from aibrix_operators.lora.serving import (
    AdapterLoadFailed,
    AdapterServerUnreachable,
    AdapterStoreUnavailable,
    fetch_adapter,
    load_on_server,
)
from aibrix_operators.serving.local_vllm import free_port

ADAPTER = Adapter("sql", "base", "s3://adapters/sql/", "ab" * 32)
FOLDER = Path("/cache/sql/abababababababab")


class VLLMLike:
    def __init__(self, runtime_loading: bool = True) -> None:
        self.loras: dict[str, str] = {}
        self.loads: list[dict] = []
        self.runtime_loading = runtime_loading
        self.race = False  # another caller loads the adapter just before this one

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        if self.runtime_loading:
            app.router.add_post("/v1/load_lora_adapter", self.load)
        return app

    async def models(self, request: web.Request) -> web.Response:
        cards = [{"id": "base", "root": "/models/base"}]
        cards += [{"id": n, "root": p} for n, p in self.loras.items()]
        return web.json_response({"object": "list", "data": cards})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.loads.append(body)
        if self.race:
            self.loras[body["lora_name"]] = body["lora_path"]
        if body["lora_name"] in self.loras and not body["load_inplace"]:
            return web.json_response({"error": {"message": "has already been loaded"}}, status=400)
        self.loras[body["lora_name"]] = body["lora_path"]
        return web.Response(text="Success")


async def serve(stub: VLLMLike) -> TestServer:
    server = TestServer(stub.app(), host="127.0.0.1")
    await server.start_server()
    return server


async def test_loads_once_then_skips_then_replaces_in_place() -> None:
    stub = VLLMLike()
    server = await serve(stub)
    url = str(server.make_url("")).rstrip("/")
    try:
        assert await load_on_server(url, {}, ADAPTER, FOLDER) is True
        assert stub.loads == [{"lora_name": "sql", "lora_path": str(FOLDER), "load_inplace": False}]
        assert await load_on_server(url, {}, ADAPTER, FOLDER) is False  # already served: no POST
        assert len(stub.loads) == 1
        newer = Path("/cache/sql/cdcdcdcdcdcdcdcd")
        assert await load_on_server(url, {}, ADAPTER, newer) is True
        assert stub.loads[-1]["load_inplace"] is True and stub.loras["sql"] == str(newer)
    finally:
        await server.close()


async def test_a_load_that_lost_a_race_to_another_shard_is_fine() -> None:
    stub = VLLMLike()
    stub.race = True
    server = await serve(stub)
    try:
        assert await load_on_server(str(server.make_url("")).rstrip("/"), {}, ADAPTER, FOLDER) is False
        assert stub.loras == {"sql": str(FOLDER)}
    finally:
        await server.close()


async def test_a_server_without_runtime_loading_says_how_to_start_it() -> None:
    server = await serve(VLLMLike(runtime_loading=False))
    try:
        with pytest.raises(AdapterLoadFailed, match="does not load adapters at run time.*"
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"):
            await load_on_server(str(server.make_url("")).rstrip("/"), {}, ADAPTER, FOLDER)
    finally:
        await server.close()


async def test_an_unreachable_server_is_an_outage_not_a_bad_adapter() -> None:
    with pytest.raises(AdapterServerUnreachable, match="cannot reach .* the task's retry loads it again"):
        await load_on_server(f"http://127.0.0.1:{free_port()}", {}, ADAPTER, FOLDER)


def test_an_unreachable_store_is_an_outage_not_a_bad_adapter(tmp_path: Path) -> None:
    """A real boto3 client pointed at a port nothing listens on: the fetch fails as an outage
    (retried as storage_error), not as adapter_load_failed, and nothing is left as verified."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{free_port()}", region_name="us-east-1",
                          aws_access_key_id="k", aws_secret_access_key="s",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=2))
    with pytest.raises(AdapterStoreUnavailable, match="LoRA adapter 'sql'.*the task's retry fetches it"):
        fetch_adapter(ADAPTER, tmp_path, client)
    assert not list((tmp_path / "sql").rglob("*.safetensors"))


@pytest.mark.parametrize("planted", ["name", "lock"])
def test_a_link_planted_in_the_lora_cache_is_refused_and_nothing_is_made_where_it_points(
    tmp_path: Path, planted: str,
) -> None:
    """The cache is a volume every worker can write: a link at ``<cache>/<name>`` or at the version's
    lock file made the fetch create folders and files where it pointed (review 2026-12-05)."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    elsewhere.mkdir()
    if planted == "name":
        (cache / ADAPTER.name).symlink_to(elsewhere)
    else:
        (cache / ADAPTER.name).mkdir()
        (cache / ADAPTER.name / f"{ADAPTER.version}.lock").symlink_to(elsewhere / "victim")
    with pytest.raises(AdapterLoadFailed, match="symbolic link or not a folder.*remove it"):
        fetch_adapter(ADAPTER, cache, object())  # never reaches the store
    assert list(elsewhere.iterdir()) == []
