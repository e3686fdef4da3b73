"""The allow-list core (no Airflow): endpoints, storage prefixes, connections, key binding."""

from __future__ import annotations

import os

import pytest

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.trust.policy import (
    DEFAULT_CHAIN,
    TrustPolicy,
    TrustViolation,
    connection_url,
    local_development_policy,
    origin,
    parse_list,
)


@pytest.fixture
def policy(tmp_path):
    (tmp_path / "allowed").mkdir()
    return TrustPolicy(
        endpoints=("http://127.0.0.1:*", "https://vllm.internal:8443/v1", "http://router"),
        storage=(str(tmp_path / "allowed"), "s3://team-bucket/batches", "s3://open-bucket"),
        aws_conn_ids=("batch_s3",),
        inference_conn_ids=("vllm_prod",),
        source="test policy",
    )


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://127.0.0.1:1/", "https://vllm.internal:8443/v1",
    "https://vllm.internal:8443/v1/", "http://router", "http://router:80/anything",
    "HTTP://127.0.0.1:9",
])
def test_allowed_endpoints(policy, url):
    policy.check_endpoint(url)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1.evil.com:8000",       # a longer host that starts like an allowed one
    "http://127.0.0.1@evil.com:8000",       # userinfo hides the real host
    "http://evil.com#@127.0.0.1:8000",
    "https://127.0.0.1:8000",               # another scheme
    "https://vllm.internal:9999/v1",        # another port
    "https://vllm.internal:8443/v10",       # a path that only starts like the allowed one
    "https://vllm.internal:8443/",
    "http://router:8080",
    "ftp://127.0.0.1:21", "not a url", "http://127.0.0.1:99999",
])
def test_refused_endpoints_name_the_rule(policy, url):
    with pytest.raises(TrustViolation) as exc:
        policy.check_endpoint(url)
    assert exc.value.rule == "allowed_endpoints"
    assert "allowed_endpoints" in str(exc.value)


def test_local_paths_must_stay_under_an_allowed_directory(policy, tmp_path):
    allowed = tmp_path / "allowed"
    policy.check_storage(str(allowed / "in.jsonl"), "input_uri")
    policy.check_storage(str(allowed), "output_uri")
    policy.check_storage(f"file://{allowed}/x/y", "output_uri")
    for bad in [str(tmp_path / "allowed-not" / "x"), str(allowed / ".." / "secret"), "/etc/passwd",
                "relative/path", "http://host/file", "gs://bucket/x"]:
        with pytest.raises(TrustViolation, match="allowed_storage"):
            policy.check_storage(bad, "input_uri")


def test_a_symlink_cannot_lead_out_of_an_allowed_directory(policy, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tmp_path / "allowed" / "link")
    with pytest.raises(TrustViolation, match="input_uri"):
        policy.check_storage(str(tmp_path / "allowed" / "link" / "in.jsonl"), "input_uri")


def test_s3_prefixes_match_on_segment_boundaries(policy):
    policy.check_storage("s3://team-bucket/batches/in.jsonl", "input_uri")
    policy.check_storage("s3://team-bucket/batches", "output_uri")
    policy.check_storage("s3://open-bucket/anything/at/all", "output_uri")
    for bad in ["s3://team-bucket/batches-other/in.jsonl", "s3://team-bucket/other", "s3://team-bucket",
                "s3://team-bucket-2/batches/x", "s3://team-bucket/batches/../other/x", "s3://"]:
        with pytest.raises(TrustViolation, match="allowed_storage"):
            policy.check_storage(bad, "input_uri")


def test_connections(policy):
    policy.check_aws_conn("batch_s3")
    with pytest.raises(TrustViolation, match="allowed_aws_conn_ids"):
        policy.check_aws_conn("aws_admin")
    with pytest.raises(TrustViolation, match="worker's own credentials"):
        policy.check_aws_conn(None)
    policy.check_inference_conn("vllm_prod")
    with pytest.raises(TrustViolation, match="allowed_inference_conn_ids"):
        policy.check_inference_conn("other")


def test_check_trigger_checks_every_named_thing(policy, tmp_path):
    ok = {"input_uri": str(tmp_path / "allowed" / "in.jsonl"), "output_uri": str(tmp_path / "allowed"),
          "aws_conn_id": "batch_s3", "endpoint": "http://127.0.0.1:8000"}
    policy.check_trigger(**ok)
    for key, bad, rule in [("input_uri", "/etc/shadow", "allowed_storage"),
                           ("output_uri", "/tmp", "allowed_storage"),
                           ("aws_conn_id", "root", "allowed_aws_conn_ids"),
                           ("endpoint", "http://10.0.0.1:8000", "allowed_endpoints")]:
        with pytest.raises(TrustViolation) as exc:
            policy.check_trigger(**{**ok, key: bad})
        assert exc.value.rule == rule


def test_local_development_default(tmp_path):
    policy = local_development_policy(tmp_path)
    policy.check_trigger(input_uri=str(tmp_path / "examples" / "a.jsonl"),
                         output_uri=str(tmp_path / ".work" / "outputs" / "r1"),
                         aws_conn_id=None, endpoint="http://localhost:8000")
    assert DEFAULT_CHAIN in policy.aws_conn_ids
    with pytest.raises(TrustViolation):
        policy.check_storage("s3://any-bucket/x", "input_uri")
    with pytest.raises(TrustViolation):
        policy.check_endpoint("http://192.168.1.5:8000")


def test_parse_list_and_connection_urls():
    assert parse_list(None) is None
    assert parse_list(" a, b\n c ,,") == ("a", "b", "c")
    assert connection_url("vllm.internal", "https", 8443) == "https://vllm.internal:8443"
    assert connection_url("http://127.0.0.1", None, 8000) == "http://127.0.0.1:8000"
    assert connection_url("127.0.0.1", "", None) == "http://127.0.0.1"
    assert origin("https://H.example/v1") == "https://h.example:443"


def test_the_api_key_goes_only_to_its_own_origin(monkeypatch):
    bound = {"api_key": "sk-planted", "api_key_origin": "http://127.0.0.1:8000", "api_key_env": None}
    assert DriverConfig("http://127.0.0.1:8000/v1", **bound).headers()["Authorization"] == "Bearer sk-planted"
    for other in ("http://127.0.0.1:8001", "https://127.0.0.1:8000", "http://localhost:8000"):
        assert "Authorization" not in DriverConfig(other, **bound).headers()
    assert "sk-planted" not in repr(DriverConfig("http://127.0.0.1:8000", **bound))
    # The env key of driver pods is bound the same way, by <ENV>_ORIGIN.
    monkeypatch.setenv("MY_KEY", "sk-env")
    assert "Authorization" not in DriverConfig("http://h:1", api_key_env="MY_KEY").headers()
    monkeypatch.setenv("MY_KEY_ORIGIN", "http://h:1")
    assert DriverConfig("http://h:1", api_key_env="MY_KEY").headers()["Authorization"] == "Bearer sk-env"
    assert "Authorization" not in DriverConfig("http://elsewhere:1", api_key_env="MY_KEY").headers()


def test_a_link_inside_an_output_tree_is_refused(policy, tmp_path):
    # Issue 19, finding 12: with out/_work linked outside the allowed roots, the cancel marker and
    # the shards landed outside. The root was resolved; what lies below it now is checked too.
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "out").mkdir()
    policy.check_trigger(output_uri=str(allowed / "out"), aws_conn_id="batch_s3")  # no link: fine
    (allowed / "out" / "_work").symlink_to(outside, target_is_directory=True)
    with pytest.raises(TrustViolation, match="symbolic link"):
        policy.check_trigger(output_uri=str(allowed / "out"), aws_conn_id="batch_s3")
    (allowed / "out" / "_work").unlink()
    (allowed / "out" / "shards").mkdir()
    (allowed / "out" / "shards" / "CANCEL").symlink_to(outside / "x")  # a dangling file link too
    with pytest.raises(TrustViolation, match="symbolic link"):
        policy.check_trigger(output_uri=f"file://{allowed / 'out'}", aws_conn_id="batch_s3")
    policy.check_trigger(output_uri=str(allowed / "fresh"), aws_conn_id="batch_s3")  # not there yet
