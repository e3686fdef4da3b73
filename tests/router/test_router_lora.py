"""LoRA adapters behind the router (router/adapters.py, router/admin.py), against stub instances
that follow vLLM's load rules: the load fans out to every instance of both roles, an instance that
already serves the folder is left alone, a new instance gets the adapters before it counts as
healthy, adapter requests reach only instances that hold the adapter, and only the deployment
(its admin token, its registry's names and folders) may load one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aibrix_operators.router.admin import TOKEN_HEADER, AdminPolicy
from aibrix_operators.router.app import ADAPTERS
from tests.router.stub_backend import StubBackend
from tests.router.test_router import make_router  # noqa: F401 - the fixture

TOKEN = "router-admin-token-0123456789abcdef"
ADMIN = {TOKEN_HEADER: TOKEN}
CACHE = Path("/cache")
PIN_V1, PIN_V2 = "0123" * 16, "4567" * 16
LOAD = {"lora_name": "sql", "lora_path": f"/cache/sql/{PIN_V1[:16]}"}
CHAT = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def write_registry(path: Path, **pins: str) -> Path:
    adapters = [{"name": name, "base_model": "m", "uri": f"s3://adapters/{name}/", "manifest_sha256": pin}
                for name, pin in pins.items()]
    path.write_text(json.dumps({"adapters": adapters}))
    return path


@pytest.fixture
def admin(tmp_path: Path) -> AdminPolicy:
    """The deployment's admin policy: a token, and a registry with one adapter, sql."""
    return AdminPolicy(token=TOKEN.encode(), registry=write_registry(tmp_path / "registry.json", sql=PIN_V1),
                       cache_dir=CACHE)


async def load(router, body: dict = LOAD, headers: dict[str, str] | None = ADMIN) -> tuple[int, dict]:
    return await router.post(body, "/v1/load_lora_adapter", headers=headers)


async def models(router) -> dict[str, str]:
    async with router.session.get(router.url + "/v1/models") as r:
        return {c["id"]: c.get("root") for c in json.loads(await r.read())["data"]}


async def test_load_fans_out_to_every_instance_of_both_roles(make_router, admin) -> None:  # noqa: F811
    p, d1, d2 = StubBackend("p"), StubBackend("d1"), StubBackend("d2")
    d2.loras["sql"] = LOAD["lora_path"]  # already serves that folder: no second load
    router = await make_router([p], [d1, d2], admin=admin)
    status, body = await load(router)
    assert (status, body) == (200, {"loaded": "sql", "instances": 3})
    assert p.loras == d1.loras == d2.loras == {"sql": LOAD["lora_path"]}
    assert d2.lora_loads == []
    assert (await models(router))["sql"] == LOAD["lora_path"]

    # A new version published to the registry (another folder) replaces the old one in place
    # everywhere, without restarting the router.
    write_registry(admin.registry, sql=PIN_V2)
    new = {"lora_name": "sql", "lora_path": f"/cache/sql/{PIN_V2[:16]}"}
    status, _ = await load(router, new)
    assert status == 200
    assert {s.loras["sql"] for s in (p, d1, d2)} == {new["lora_path"]}
    assert all(s.lora_loads[-1]["load_inplace"] for s in (p, d1, d2))


async def test_a_failed_load_is_not_remembered_and_changes_no_routing(make_router, admin) -> None:  # noqa: F811
    d1, d2 = StubBackend("d1"), StubBackend("d2")
    d2.lora_answer = (500, "out of LoRA slots")
    router = await make_router([], [d1, d2], admin=admin)
    status, body = await load(router)
    assert status == 502
    assert body["error"]["code"] == "lora_load_failed"
    message = body["error"]["message"]
    assert "1 of 2 instance(s)" in message and "out of LoRA slots" in message
    # Not remembered: not listed (so the caller loads again), and routing is as before the load,
    # base model and adapter name alike, to both instances.
    assert router.server.app[ADAPTERS].wanted == {}
    assert "sql" not in await models(router)
    for _ in range(8):
        assert (await router.post({**CHAT, "model": "m"}, "/v1/chat/completions"))[0] == 200
        assert (await router.post(CHAT, "/v1/chat/completions"))[0] == 200
    assert len(d1.received) > 0 and len(d2.received) > 0
    # A restarted d2 is not synced with a load that failed; the caller's retry loads it.
    d2.healthy = False
    await router.refresh()
    d2.healthy, d2.lora_answer = True, None
    await router.refresh()
    assert d2.loras == {} and len(d2.lora_loads) == 1
    assert (await load(router)) == (200, {"loaded": "sql", "instances": 2})
    assert d2.loras == {"sql": LOAD["lora_path"]}


async def test_adapter_requests_skip_a_prefill_without_it(make_router, admin) -> None:  # noqa: F811
    p, d = StubBackend("p"), StubBackend("d")
    p.healthy = False
    router = await make_router([p], [d], admin=admin)
    await router.refresh()
    assert (await load(router)) == (200, {"loaded": "sql", "instances": 1})
    # The prefill comes back but cannot load the adapter: it serves, not that adapter.
    p.healthy, p.lora_answer = True, (500, "broken")
    await router.refresh()
    assert p.healthy and "sql" not in p.loras
    status, _ = await router.post(CHAT, "/v1/chat/completions")
    assert status == 200
    # Decode computed the prompt itself; the prefill that lacks the adapter got nothing.
    assert p.received == [] and len(d.received) == 1


async def test_an_instance_that_comes_back_gets_the_adapters_before_it_serves(make_router, admin) -> None:  # noqa: F811
    d1, d2 = StubBackend("d1"), StubBackend("d2")
    d2.healthy = False
    router = await make_router([], [d1, d2], admin=admin)
    await router.refresh()
    assert (await load(router)) == (200, {"loaded": "sql", "instances": 1})
    assert d2.loras == {}
    # d2 starts (a restarted vLLM has no adapter loaded at run time): synced, then healthy.
    d2.healthy = True
    await router.refresh()
    assert d2.loras == {"sql": LOAD["lora_path"]}
    for _ in range(8):
        await router.post(CHAT, "/v1/chat/completions")
    assert d1.received and d2.received


async def test_a_bad_load_request_is_refused(make_router, admin) -> None:  # noqa: F811
    router = await make_router([], [StubBackend("d")], admin=admin)
    status, body = await load(router, {"lora_name": "sql"})
    assert status == 400 and body["error"]["code"] == "invalid_request"


async def test_an_adapter_loaded_behind_the_routers_back_is_not_listed_until_it_fans_out(
    make_router, admin,  # noqa: F811
) -> None:
    """One instance already has the adapter (from an earlier run straight to it), the other does
    not: the router's list must not say it is loaded, or the dispatch task would skip the load
    and the adapter's requests would reach the instance without it."""
    d1, d2 = StubBackend("d1"), StubBackend("d2")
    d1.loras["sql"] = LOAD["lora_path"]
    router = await make_router([], [d1, d2], admin=admin)
    for _ in range(3):  # whichever instance answers the listing
        assert set(await models(router)) == {"m"}
    status, _ = await load(router)
    assert status == 200 and d2.loras == {"sql": LOAD["lora_path"]} and d1.lora_loads == []
    assert (await models(router))["sql"] == LOAD["lora_path"]


async def test_the_admin_route_needs_the_deployments_token(make_router, admin) -> None:  # noqa: F811
    """Finding 1 of the 2026-12-05 review: without a key, a load changed what every instance served."""
    d = StubBackend("d")
    router = await make_router([], [d], admin=admin)
    wrong = (None, {TOKEN_HEADER: ""}, {TOKEN_HEADER: TOKEN[:-1]}, {"Authorization": f"Bearer {TOKEN}"})
    for headers in wrong:
        status, body = await load(router, headers=headers)
        assert (status, body["error"]["code"]) == (401, "invalid_admin_token"), headers
    assert d.lora_loads == [] and router.server.app[ADAPTERS].wanted == {}
    # No token configured: the route is off, whatever is sent.
    off = await make_router([], [StubBackend("d2")])
    status, body = await load(off)
    assert (status, body["error"]["code"]) == (403, "admin_disabled")
    assert (await load(router))[0] == 200


async def test_only_registry_adapters_from_their_own_folders_load(make_router, admin, tmp_path) -> None:  # noqa: F811
    d = StubBackend("d")
    d.loras["other"] = "/cache/other/89ab89ab89ab89ab"  # an adapter loaded behind the router's back
    write_registry(admin.registry, sql=PIN_V1, other="89ab" * 16)
    router = await make_router([], [d], admin=admin)
    refused = [
        # The served base model with a bogus folder: every base-model request would have been 503.
        ({"lora_name": "m", "lora_path": "/tmp/bogus"}, 400, "not_an_adapter"),
        # A registered name pointed at another adapter's verified folder (or anywhere else).
        ({"lora_name": "sql", "lora_path": "/cache/other/89ab89ab89ab89ab"}, 400, "lora_path_mismatch"),
        ({"lora_name": "sql", "lora_path": f"/cache/sql/{PIN_V1[:16]}/../../other/89ab89ab89ab89ab"}, 400,
         "lora_path_mismatch"),
        # A made-up name: never remembered, so never re-synced by the health loop.
        ({"lora_name": "made-up-7", "lora_path": "/cache/made-up-7/0000"}, 404, "unknown_adapter"),
    ]
    for body, status, code in refused:
        got, answer = await load(router, body)
        assert (got, answer["error"]["code"]) == (status, code), body
    assert d.lora_loads == [] and router.server.app[ADAPTERS].wanted == {}
    for _ in range(4):  # the base model is still served
        assert (await router.post({**CHAT, "model": "m"}, "/v1/chat/completions"))[0] == 200
    assert (await load(router)) == (200, {"loaded": "sql", "instances": 1})
    assert router.server.app[ADAPTERS].wanted == {"sql": LOAD["lora_path"]}
