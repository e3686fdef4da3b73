"""Driver pod spec (pure) and the judgement of a pod's end; the provider's own pod builder on top."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from kubernetes.client import ApiClient

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver_pods.outcome import judge_pod, parse_outcome
from aibrix_operators.driver_pods.spec import DriverPodRequest, DriverPodSettings, build_driver_pod
from aibrix_operators.operators.step_errors import step_error_code
from aibrix_operators.trust.policy import TrustViolation

NOW = 1_800_000_000.0
REQ = DriverPodRequest(
    batch_id="batch_0a750e3a913c42cf9aa498ddbbbcaf08",
    shard_index=3,
    shard_uri="s3://b/out/_work/run/shards/shard-00003.jsonl",
    results_prefix="s3://b/out/_work/run/results/shard-00003",
    total_requests=5000,
    attempt=2,
    config=DriverConfig(endpoint="http://router.batch.svc:8000", deadline=NOW + 3600,
                        cancel_uri="s3://b/out/_work/run/CANCEL", cache_salt="tenant-0f3a"),
    model="llama",
)


def test_pod_spec_has_args_labels_deadline_and_only_secret_references() -> None:
    pod = build_driver_pod(DriverPodSettings(namespace="batch"), REQ, now=NOW)
    m = pod.manifest()
    c = m["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "aibrix_operators.driver.cli"]
    args = c["args"]
    assert args[args.index("--shard-uri") + 1] == REQ.shard_uri
    assert args[args.index("--results-prefix") + 1] == REQ.results_prefix
    assert args[args.index("--total") + 1] == "5000" and args[args.index("--model") + 1] == "llama"
    (config,) = [a.removeprefix("--config-json=") for a in args if a.startswith("--config-json=")]
    sent = DriverConfig.from_json(config)
    assert sent.endpoint == REQ.config.endpoint and sent.deadline == NOW + 3600
    assert sent.cancel_uri == REQ.config.cancel_uri  # pods stop on a cancel too
    assert sent.cache_salt == "tenant-0f3a"  # a tenant's pods keep its salt
    assert m["metadata"]["labels"]["aibrix.ai/batch-id"] == REQ.batch_id
    assert m["metadata"]["labels"]["aibrix.ai/shard-index"] == "3"
    assert m["metadata"]["labels"]["aibrix.ai/attempt"] == "2"
    assert m["metadata"]["namespace"] == "batch"
    assert m["spec"]["activeDeadlineSeconds"] == 3600 + 600  # window left + grace
    assert m["spec"]["automountServiceAccountToken"] is False
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": "512Mi"}
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert secret_env["AWS_SECRET_ACCESS_KEY"] == {
        "name": "aibrix-batch-s3",
        "key": "AWS_SECRET_ACCESS_KEY",
        "optional": False,
    }
    assert secret_env["OPENAI_API_KEY"]["name"] == "aibrix-batch-inference"
    assert secret_env["OPENAI_API_KEY_ORIGIN"]["name"] == "aibrix-batch-inference"
    literal = {e["name"] for e in c["env"] if "value" in e}
    # no secret as a literal: only the driver's own settings (metrics: tests/metrics/)
    assert literal == {"PYTHONUNBUFFERED", "AIBRIX_DRIVER_METRICS_PORT", "AIBRIX_DRIVER_METRICS_ADDR"}


def test_pod_manifest_is_valid_kubernetes_1_33() -> None:
    import kubernetes_validate

    manifest = build_driver_pod(DriverPodSettings(), REQ, now=NOW).manifest()
    manifest["metadata"]["name"] += "-abcd1234"
    kubernetes_validate.validate(manifest, "1.33", strict=True)


def test_window_already_over_still_gets_a_minute() -> None:
    pod = build_driver_pod(DriverPodSettings(deadline_grace_s=0), REQ, now=REQ.deadline + 500)
    assert pod.active_deadline_seconds == 60


def test_namespace_and_service_account_only_from_the_allow_list() -> None:
    settings = DriverPodSettings(namespace="batch", allowed_namespaces=("batch-b",))
    assert settings.choose_namespace(None) == "batch"
    assert settings.choose_namespace("batch-b") == "batch-b"
    with pytest.raises(TrustViolation, match="allowed_kubernetes_namespaces"):
        settings.choose_namespace("kube-system")
    with pytest.raises(TrustViolation, match="allowed_kubernetes_service_accounts"):
        settings.choose_service_account("cluster-admin")


def test_provider_builds_the_pod_with_secret_refs_and_no_secret_values() -> None:
    from aibrix_operators.operators.driver_pod import DriverPodRunner

    settings = DriverPodSettings(namespace="batch")
    runner = DriverPodRunner(pod=build_driver_pod(settings, REQ, now=NOW), settings=settings)
    pod = ApiClient().sanitize_for_serialization(runner.pod_request(context=None))
    spec = pod["spec"]
    c = spec["containers"][0]
    assert c["name"] == "base" and c["image"] == settings.image
    assert spec["serviceAccountName"] == "aibrix-batch-driver" and spec["activeDeadlineSeconds"] == 4200
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    refs = [e for e in c["env"] if "valueFrom" in e]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in refs} == {
        "aibrix-batch-s3",
        "aibrix-batch-inference",
    }
    assert all("value" not in e for e in refs)
    assert pod["metadata"]["labels"]["aibrix.ai/shard-index"] == "3"


def _pod(phase: str, state: dict, **status) -> dict:
    return {
        "status": {
            "phase": phase,
            "containerStatuses": [{"name": "base", "image": "img:1", "state": state}],
            **status,
        }
    }


OUTCOME = {"shard": "s", "total": 3, "completed": 2, "failed": 1, "resumed_failed": 0}


def test_exit_0_and_1_are_finished_shards_with_the_outcome_line() -> None:
    logs = ["2026 INFO progress", json.dumps(OUTCOME), "2026 WARNING 1 of 3 requests ended as error lines"]
    term = {"terminated": {"exitCode": 1, "startedAt": "2027-01-15T08:00:00Z"}}
    verdict = judge_pod(_pod("Failed", term), logs, "p")
    assert verdict.failure is None and verdict.outcome["failed"] == 1
    assert verdict.outcome["started_at"] == int(datetime(2027, 1, 15, 8, tzinfo=UTC).timestamp())
    assert parse_outcome(["{not json", '{"a": 1}']) is None


@pytest.mark.parametrize(
    ("pod", "code", "retryable"),
    [
        (_pod("Failed", {"terminated": {"exitCode": 3}}), "endpoint_unavailable", True),
        (_pod("Failed", {"terminated": {"exitCode": 4}}), "model_not_served", False),
        (_pod("Failed", {"terminated": {"exitCode": 5}}), "storage_error", True),
        (_pod("Failed", {"terminated": {"exitCode": 6}}), "input_changed", False),
        (_pod("Failed", {"terminated": {"exitCode": 137}}), "driver_pod_failed", True),
        (
            _pod("Failed", {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}),
            "driver_pod_oom_killed",
            True,
        ),
        (
            _pod("Failed", {"terminated": {"exitCode": 137}}, reason="Evicted", message="low memory"),
            "driver_pod_evicted",
            True,
        ),
        (
            _pod("Failed", {"terminated": {"exitCode": 137}}, reason="DeadlineExceeded"),
            "driver_pod_deadline_exceeded",
            True,
        ),
        (
            _pod("Pending", {"waiting": {"reason": "ErrImagePull", "message": "not found"}}),
            "driver_image_pull_failed",
            False,
        ),
        (
            _pod(
                "Pending",
                {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "s" not found'}},
            ),
            "driver_pod_config_error",
            False,
        ),
        (
            {
                "status": {
                    "phase": "Pending",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "Insufficient cpu",
                        }
                    ],
                }
            },
            "driver_pod_unschedulable",
            True,
        ),
        (_pod("Succeeded", {"terminated": {"exitCode": 0}}), "driver_outcome_missing", True),
        (None, "driver_pod_lost", True),
    ],
)
def test_failures_have_specific_codes(pod: dict | None, code: str, retryable: bool) -> None:
    verdict = judge_pod(pod, [], "aibrix-driver-x-00001-abc")
    assert verdict.outcome is None and verdict.failure is not None
    assert (verdict.failure.error_code, verdict.failure.retryable) == (code, retryable)
    assert "aibrix-driver-x-00001-abc" in str(verdict.failure)
    assert step_error_code(RuntimeError("wrapped").with_traceback(None), "dispatch") == "dispatch_failed"
    try:
        raise RuntimeError(str(verdict.failure)) from verdict.failure
    except RuntimeError as exc:
        assert step_error_code(exc, "dispatch") == code
