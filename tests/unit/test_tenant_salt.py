"""The Batch API's per-tenant cache_salt: a claim bound to its run, never the salt in a conf."""

from __future__ import annotations

import json

import pytest

from aibrix_operators.batch_api.batches import API_CONF_KEY, dag_conf
from aibrix_operators.batch_api.settings import ApiSettings, ModelRoute
from aibrix_operators.batch_api.tenant_salt import (
    CLAIM_KEY,
    SaltClaimRefused,
    load_cache_salt_key,
    salt_claim,
    salt_for_run,
    tenant_cache_salt,
)

KEY = b"k" * 32


def test_a_claim_verifies_only_in_its_own_run() -> None:
    claim = salt_claim(KEY, "api__alpha__batch_1", "alpha")
    assert salt_for_run("api__alpha__batch_1", claim, None, lambda: KEY) == tenant_cache_salt(KEY, "alpha")
    # Copied into a run of one's own: refused, and the message says why.
    with pytest.raises(SaltClaimRefused, match="copied from another run"):
        salt_for_run("manual__2026-12-01", claim, None, lambda: KEY)
    # Naming another tenant with the same tag: refused.
    with pytest.raises(SaltClaimRefused):
        salt_for_run("api__alpha__batch_1", {**claim, "tenant": "beta"}, None, lambda: KEY)
    # Another key (the Variable changed): refused, not silently another salt.
    with pytest.raises(SaltClaimRefused):
        salt_for_run("api__alpha__batch_1", claim, None, lambda: b"other")


def test_a_claim_without_the_key_or_malformed_fails_by_name() -> None:
    claim = salt_claim(KEY, "r", "alpha")
    with pytest.raises(SaltClaimRefused, match="aibrix_batch_cache_salt_key"):
        salt_for_run("r", claim, None, lambda: None)
    for bad in ("x", {"tenant": "alpha"}, {"tenant": 1, "tag": "t"}, []):
        with pytest.raises(SaltClaimRefused, match="malformed"):
            salt_for_run("r", bad, None, lambda: KEY)


def test_a_trigger_param_can_never_be_a_tenant_salt() -> None:
    learnt = tenant_cache_salt(KEY, "alpha")
    assert salt_for_run("manual__1", None, learnt, lambda: KEY) == "param:" + learnt
    assert salt_for_run("manual__1", None, None, lambda: KEY) is None
    # The tag is not the salt either (separate HMAC messages).
    assert salt_claim(KEY, "r", "alpha")["tag"] not in learnt


def test_the_api_conf_holds_a_claim_and_no_salt() -> None:
    settings = ApiSettings(storage_root="/tmp/x")
    route = ModelRoute(endpoint="http://127.0.0.1:1")
    claim = salt_claim(KEY, "api__alpha__b", "alpha")
    conf = dag_conf(settings, "alpha", "batch_b", "file-1", "/tmp/x/in.jsonl", "/v1/chat/completions",
                    "24h", {}, "m", route, 1, "d", claim)
    assert conf["cache_salt"] is None and conf[API_CONF_KEY][CLAIM_KEY] == claim
    assert tenant_cache_salt(KEY, "alpha") not in json.dumps(conf)
    off = dag_conf(settings, "alpha", "batch_b", "file-1", "/tmp/x/in.jsonl", "/v1/chat/completions",
                   "24h", {}, "m", route, 1, "d", None)
    assert CLAIM_KEY not in off[API_CONF_KEY]


def test_without_the_variable_the_api_stores_a_key_for_the_workers() -> None:
    stored: dict[str, str] = {}
    key = load_cache_salt_key(None, lambda: stored.get("v"), lambda value: stored.__setitem__("v", value))
    assert key == stored["v"].encode() and len(stored["v"]) == 64
    # The next process reads the same key.
    assert load_cache_salt_key(None, lambda: stored.get("v"), lambda value: pytest.fail("rewritten")) == key
    assert load_cache_salt_key("off", lambda: pytest.fail("read"), lambda v: pytest.fail("written")) is None
    with pytest.raises(ValueError, match="api_cache_salt"):
        load_cache_salt_key("on", lambda: None, lambda v: None)
