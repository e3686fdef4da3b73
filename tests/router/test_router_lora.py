"""LoRA adapters behind the router (router/adapters.py), against stub instances that follow
vLLM's load rules: the load fans out to every instance of both roles, an instance that already
serves the folder is left alone, a new instance gets the adapters before it counts as healthy,
and adapter requests reach only instances that hold the adapter."""

from __future__ import annotations

import json

from tests.router.stub_backend import StubBackend
from tests.router.test_router import make_router  # noqa: F401 - the fixture

LOAD = {"lora_name": "sql", "lora_path": "/cache/sql/0123"}
CHAT = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def models(router) -> dict[str, str]:
    async with router.session.get(router.url + "/v1/models") as r:
        return {c["id"]: c.get("root") for c in json.loads(await r.read())["data"]}


async def test_load_fans_out_to_every_instance_of_both_roles(make_router) -> None:  # noqa: F811
    p, d1, d2 = StubBackend("p"), StubBackend("d1"), StubBackend("d2")
    d2.loras["sql"] = LOAD["lora_path"]  # already serves that folder: no second load
    router = await make_router([p], [d1, d2])
    status, body = await router.post(LOAD, "/v1/load_lora_adapter")
    assert (status, body) == (200, {"loaded": "sql", "instances": 3})
    assert p.loras == d1.loras == d2.loras == {"sql": LOAD["lora_path"]}
    assert d2.lora_loads == []
    assert (await models(router))["sql"] == LOAD["lora_path"]

    # A new version (another folder) replaces the old one in place everywhere.
    new = {"lora_name": "sql", "lora_path": "/cache/sql/4567"}
    status, _ = await router.post(new, "/v1/load_lora_adapter")
    assert status == 200
    assert {s.loras["sql"] for s in (p, d1, d2)} == {"/cache/sql/4567"}
    assert all(s.lora_loads[-1]["load_inplace"] for s in (p, d1, d2))


async def test_a_failed_instance_fails_the_load_and_serves_no_adapter_request(make_router) -> None:  # noqa: F811
    d1, d2 = StubBackend("d1"), StubBackend("d2")
    d2.lora_answer = (500, "out of LoRA slots")
    router = await make_router([], [d1, d2])
    status, body = await router.post(LOAD, "/v1/load_lora_adapter")
    assert status == 502
    assert body["error"]["code"] == "lora_load_failed"
    message = body["error"]["message"]
    assert "1 of 2 instance(s)" in message and "out of LoRA slots" in message
    # Not every instance holds it: /v1/models does not say it is loaded (so a caller loads again).
    assert "sql" not in await models(router)
    for _ in range(6):
        assert (await router.post(CHAT, "/v1/chat/completions"))[0] == 200
    assert len(d1.received) == 6 and d2.received == []
    # The base model still goes to both.
    for _ in range(6):
        await router.post({**CHAT, "model": "m"}, "/v1/chat/completions")
    assert len(d2.received) > 0


async def test_adapter_requests_skip_a_prefill_without_it(make_router) -> None:  # noqa: F811
    p, d = StubBackend("p"), StubBackend("d")
    p.lora_answer = (500, "broken")
    router = await make_router([p], [d])
    assert (await router.post(LOAD, "/v1/load_lora_adapter"))[0] == 502
    status, _ = await router.post(CHAT, "/v1/chat/completions")
    assert status == 200
    # Decode computed the prompt itself; the prefill that lacks the adapter got nothing.
    assert p.received == [] and len(d.received) == 1


async def test_an_instance_that_comes_back_gets_the_adapters_before_it_serves(make_router) -> None:  # noqa: F811
    d1, d2 = StubBackend("d1"), StubBackend("d2")
    d2.healthy = False
    router = await make_router([], [d1, d2])
    await router.refresh()
    assert (await router.post(LOAD, "/v1/load_lora_adapter")) == (200, {"loaded": "sql", "instances": 1})
    assert d2.loras == {}
    # d2 starts (a restarted vLLM has no adapter loaded at run time): synced, then healthy.
    d2.healthy = True
    await router.refresh()
    assert d2.loras == {"sql": LOAD["lora_path"]}
    for _ in range(8):
        await router.post(CHAT, "/v1/chat/completions")
    assert d1.received and d2.received


async def test_a_bad_load_request_is_refused(make_router) -> None:  # noqa: F811
    router = await make_router([], [StubBackend("d")])
    status, body = await router.post({"lora_name": "sql"}, "/v1/load_lora_adapter")
    assert status == 400 and body["error"]["code"] == "invalid_request"


async def test_an_adapter_loaded_behind_the_routers_back_is_not_listed_until_it_fans_out(
    make_router,  # noqa: F811
) -> None:
    """One instance already has the adapter (from an earlier run straight to it), the other does
    not: the router's list must not say it is loaded, or the dispatch task would skip the load
    and the adapter's requests would reach the instance without it."""
    d1, d2 = StubBackend("d1"), StubBackend("d2")
    d1.loras["sql"] = LOAD["lora_path"]
    router = await make_router([], [d1, d2])
    for _ in range(3):  # whichever instance answers the listing
        assert set(await models(router)) == {"m"}
    status, _ = await router.post(LOAD, "/v1/load_lora_adapter")
    assert status == 200 and d2.loras == {"sql": LOAD["lora_path"]} and d1.lora_loads == []
    assert (await models(router))["sql"] == LOAD["lora_path"]
