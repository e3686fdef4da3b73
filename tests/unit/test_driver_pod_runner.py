"""``DriverPodRunner`` against a Kubernetes API: create, defer on the provider's trigger, resume,
judge; reattach; faults. The API is ``kube_target``: by default the double, its pods local
processes (what is tested here is the API conversation, not the image;
tests/integration/test_dag_kubernetes.py runs the real driver image in a whole DAG); with
K8S_TEST_KUBECONFIG a real cluster, in a namespace of its own, pods running K8S_TEST_DRIVER_IMAGE
(tests/k8s_double/target.py). Tests that inject answers or install RBAC into the double are
``double_only``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from airflow.providers.cncf.kubernetes.pod_generator import make_safe_label_value
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.sdk.exceptions import TaskDeferred
from kubernetes.client import ApiClient

from aibrix_operators.driver_pods.outcome import DriverPodFailure
from aibrix_operators.driver_pods.spec import DriverPodSettings, build_driver_pod
from aibrix_operators.operators.driver_pod import REDEFERS_KEY, RESUME_METHOD, DriverPodRunner
from tests.k8s_double.fixtures import LOCAL_PYTHON_IMAGE, kube_target  # noqa: F401 - fixture
from tests.k8s_double.rbac import Authorizer
from tests.k8s_double.target import KubeTarget
from tests.unit.test_driver_pods import NOW, REQ
from tests.unit.test_k8s_manifests import render

NS = "batch"
RUN_ID = "manual__2026-01-01T00:00:00+00:00"
OUTCOME = {"total": 2, "completed": 2, "failed": 0, "resumed": 0}


class Ti:
    def __init__(self, try_number: int = 1) -> None:
        self.dag_id, self.task_id, self.run_id = "batch_inference", "dispatch", RUN_ID
        self.map_index, self.try_number = 3, try_number
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


class Store:
    """``task_state_store`` as the task runner gives it (get/set of JSON values)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def set(self, key: str, value: Any, **_: Any) -> None:
        self.values[key] = value


def context(try_number: int = 1, store: Store | None = None) -> dict[str, Any]:
    ctx: dict[str, Any] = {"ti": Ti(try_number), "run_id": RUN_ID}
    if store is not None:
        ctx["task_state_store"] = store
    return ctx


def make_runner(code: str, try_number: int = 1, *, ns: str = NS, image: str = LOCAL_PYTHON_IMAGE,
                patience: float = 1.0) -> DriverPodRunner:
    settings = DriverPodSettings(namespace=ns, image=image, poll_interval_s=0.2,
                                 startup_timeout_s=30 * patience, schedule_timeout_s=30 * patience)
    pod = build_driver_pod(settings, dataclasses.replace(REQ, attempt=try_number), now=NOW)
    return DriverPodRunner(pod=dataclasses.replace(pod, command=["python", "-c", code], args=[]),
                           settings=settings)


@pytest.fixture
def cluster(kube_target: KubeTarget, monkeypatch: pytest.MonkeyPatch) -> KubeTarget:  # noqa: F811
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", kube_target.airflow_connection())
    monkeypatch.delenv("KUBECONFIG", raising=False)
    kube_target.add_secret("aibrix-batch-s3", {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"})
    kube_target.add_secret("aibrix-batch-inference", {})
    # A real server refuses a pod whose ServiceAccount is missing (the double does not check).
    kube_target.create("serviceaccounts", {"metadata": {"name": DriverPodSettings().service_account}})
    return kube_target


@pytest.fixture
def runner(cluster: KubeTarget) -> Callable[..., DriverPodRunner]:
    """``make_runner`` in the target's namespace, with its image and patience."""
    return functools.partial(make_runner, ns=cluster.namespace, image=cluster.image,
                             patience=cluster.patience)


def deferred(call, *args) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as info:
        call(*args)
    assert info.value.method_name == RESUME_METHOD
    assert isinstance(info.value.trigger, KubernetesPodTrigger)
    return info.value


def fire(trigger: KubernetesPodTrigger) -> dict[str, Any]:
    """Run the provider's trigger as the triggerer would (rebuilt from its serialized form)."""
    _, kwargs = trigger.serialize()

    async def first() -> dict[str, Any]:
        async for event in KubernetesPodTrigger(**kwargs).run():
            return event.payload
        raise AssertionError("the trigger sent nothing")

    return asyncio.run(first())


def test_the_pod_request_is_the_driver_pod_plus_the_task_labels():
    r = make_runner("pass")
    sent = ApiClient().sanitize_for_serialization(r.pod_request(context()))
    want = r.spec.manifest()
    assert sent["metadata"]["name"].startswith(r.spec.name + "-") and len(sent["metadata"]["name"]) == len(
        r.spec.name) + 9
    assert sent["metadata"]["labels"] == {
        **want["metadata"]["labels"], "dag_id": "batch_inference", "task_id": "dispatch",
        "run_id": make_safe_label_value(RUN_ID), "map_index": "3", "try_number": "1",
    }
    assert sent["metadata"]["annotations"] == want["metadata"]["annotations"]
    sent["spec"]["containers"][0].pop("terminationMessagePolicy")
    assert sent["spec"] == want["spec"]  # every field: env refs, ports, resources, contexts, deadline


@pytest.mark.service
def test_a_pod_is_created_deferred_on_the_provider_trigger_and_judged(cluster, runner, caplog):
    code = f"import json; print('working'); print(json.dumps({OUTCOME!r}))"
    ctx = context()
    deferral = deferred(runner(code).start, ctx)
    name = deferral.trigger.pod_name
    assert ctx["ti"].xcoms == {"pod_name": name, "pod_namespace": cluster.namespace}
    [pod] = cluster.pods()
    assert pod["metadata"]["name"] == name and pod["spec"]["automountServiceAccountToken"] is False
    event = fire(deferral.trigger)
    assert event["status"] == "success" and event["name"] == name
    with caplog.at_level(logging.INFO):
        verdict = runner(code).finish(ctx, event)  # a new runner, as after a resume
    assert verdict.failure is None and verdict.outcome["completed"] == 2
    assert "[base] working" in caplog.text
    cluster.wait_for(lambda: cluster.pods() == [], 10, "the finished pod deleted")


@pytest.mark.service  # the cluster's kubelet runs pods as processes; kubectl renders the Roles
@pytest.mark.double_only("installs the rendered Roles as the double's authorizer; a real cluster's RBAC "
                         "is its own, for the kubeconfig's user")
def test_the_roles_we_ship_grant_every_call_of_a_shard_and_no_more(cluster, runner):
    """The double authorizes each request against the Roles the plain overlay renders, bound to
    the Airflow workers' ServiceAccount: a shard's whole life (create, the provider trigger's
    reads, the log, the delete) passes; a Role without ``delete`` on pods leaves the call refused
    with RBAC's own text."""
    docs = [dict(d) for d in render("plain")]
    api = cluster.double.api
    api.rbac = Authorizer.from_manifests(docs, "aibrix-batch-airflow", NS)
    code = f"import json; print(json.dumps({OUTCOME!r}))"
    ctx = context()
    deferral = deferred(runner(code).start, ctx)
    event = fire(deferral.trigger)
    assert event["status"] == "success", event
    assert runner(code).finish(ctx, event).failure is None
    cluster.wait_for(lambda: cluster.pods() == [], 10, "the finished pod deleted")
    assert [r for r in api.store.requests if r[0] == "DELETE"], "the pod went through the API"

    # Mutation: the same Roles without delete on pods. The API says who may not do what.
    for doc in docs:
        for rule in doc.get("rules", []) if doc["kind"] == "Role" else []:
            if "pods" in rule["resources"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != "delete"]
    api.rbac = Authorizer.from_manifests(docs, "aibrix-batch-airflow", NS)
    request = urllib.request.Request(f"{cluster.double.url}/api/v1/namespaces/{NS}/pods/any-pod",
                                     method="DELETE", headers={"Authorization": f"Bearer {api.token}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 403
    assert json.load(info.value)["message"] == (
        'pods "any-pod" is forbidden: User "system:serviceaccount:batch:aibrix-batch-airflow" cannot delete '
        'resource "pods" in API group "" in the namespace "batch"')


@pytest.mark.service
def test_a_failed_pod_is_judged_from_its_exit_code_and_log(cluster, runner):
    code = "import sys; print('x ERROR shard: no such key'); sys.exit(5)"
    deferral = deferred(runner(code).start, context())
    event = fire(deferral.trigger)
    assert event["status"] == "failed"
    verdict = runner("").finish(context(), event)
    assert verdict.failure.error_code == "storage_error" and verdict.failure.retryable
    assert "no such key" in str(verdict.failure)


@pytest.mark.service
def test_a_start_again_reattaches_to_this_tries_pod_and_a_retry_to_a_running_one(cluster, runner):
    sleeper = "import time; time.sleep(60)"
    store = Store()
    first = deferred(runner(sleeper).start, context(store=store)).trigger.pod_name
    assert store.values["pod_identifier"] == {"name": first, "namespace": cluster.namespace}
    cluster.wait_for(cluster.running, 10, "the pod running")
    # The same try again (the worker died before it deferred): found by its labels, no duplicate.
    assert deferred(runner(sleeper).start, context()).trigger.pod_name == first
    # The next try, while the old pod still runs: reattached through task_state_store.
    assert deferred(runner(sleeper, 2).start, context(2, store)).trigger.pod_name == first
    assert len(cluster.pods()) == 1
    # Without the stored identity the next try's labels differ: a pod of its own.
    second = deferred(runner(sleeper, 2).start, context(2)).trigger.pod_name
    assert second != first and len(cluster.pods()) == 2
    for name in (first, second):
        r = runner(sleeper)
        r.pod = r.pods.read_pod(_ref(name, cluster.namespace))
        r.on_kill()


@pytest.mark.service
def test_a_finished_pod_is_not_reattached(cluster, runner):
    store = Store()
    name = deferred(runner("pass").start, context(store=store)).trigger.pod_name
    def phase() -> str | None:
        return (cluster.pod(name) or {}).get("status", {}).get("phase")

    cluster.wait_for(lambda: phase() == "Succeeded", 10, "the pod done")
    again = deferred(runner("pass").start, context(store=store)).trigger.pod_name
    assert again != name and [p["metadata"]["name"] for p in cluster.pods()] == [again]


@pytest.mark.service
def test_an_error_event_on_a_running_pod_defers_again_then_waits_for_it(cluster, runner):
    code = f"import json, time; time.sleep(2); print(json.dumps({OUTCOME!r}))"
    name = deferred(runner(code).start, context()).trigger.pod_name
    cluster.wait_for(cluster.running, 10, "the pod running")
    error = {"status": "error", "name": name, "namespace": cluster.namespace, "message": "watch broke"}
    again = deferred(runner(code).finish, context(), error)
    assert again.trigger.pod_name == name and again.trigger.trigger_kwargs == {REDEFERS_KEY: 1}
    # After the last re-deferral the pod is waited for in the worker, then judged.
    verdict = runner(code).finish(context(), {**error, REDEFERS_KEY: 3})
    assert verdict.outcome["completed"] == 2


@pytest.mark.service  # the cluster's kubelet runs pods as processes
def test_a_pod_gone_before_resume_is_lost(cluster, runner):
    event = {"status": "success", "name": "aibrix-driver-x", "namespace": cluster.namespace}
    verdict = runner("").finish(context(), event)
    assert verdict.failure.error_code == "driver_pod_lost" and verdict.failure.retryable


@pytest.mark.service  # the cluster's kubelet runs pods as processes
@pytest.mark.double_only("injects 409 and 403 answers into the double (a real server cannot be told to)")
def test_api_faults_on_create_conflict_is_retried_forbidden_fails_at_once(cluster, runner):
    conflict = cluster.double.api.fail("POST", rf"/namespaces/{NS}/pods$", 409)
    deferred(runner("pass").start, context())
    assert conflict.hits == 1 and len(cluster.pods()) == 1
    cluster.double.api.fail("POST", rf"/namespaces/{NS}/pods$", 403, times=10, message="pods is forbidden")
    with pytest.raises(DriverPodFailure) as info:
        runner("pass").start(context(2))
    assert info.value.error_code == "kubernetes_forbidden" and not info.value.retryable
    assert "403" in str(info.value)


# The API server's own 403 texts (its admission plugins and RBAC authorizer), as a real cluster
# answers them: a 403 is not always missing rights (issue 37: the double used to answer only RBAC).
REAL_403 = {
    "quota": 'pods "aibrix-driver-x" is forbidden: exceeded quota: batch-quota, requested: '
             "limits.memory=1Gi, used: limits.memory=4Gi, limited: limits.memory=4Gi",
    "limit_range": 'pods "aibrix-driver-x" is forbidden: maximum memory usage per Container is 256Mi, '
                   "but limit is 1Gi",
    "pod_security": 'pods "aibrix-driver-x" is forbidden: violates PodSecurity "restricted:latest": '
                    'seccompProfile (pod or container "driver" must set securityContext.seccompProfile'
                    '.type to "RuntimeDefault" or "Localhost")',
    "service_account": 'pods "aibrix-driver-x" is forbidden: error looking up service account '
                       'batch/driver: serviceaccount "driver" not found',
    "rbac": 'pods is forbidden: User "system:serviceaccount:airflow:worker" cannot create resource '
            '"pods" in API group "" in the namespace "batch"',
}


@pytest.mark.service  # the cluster's kubelet runs pods as processes
@pytest.mark.parametrize(("kind", "code", "retryable"), [
    ("quota", "kubernetes_quota_exceeded", True),
    ("limit_range", "kubernetes_pod_refused", False),
    ("pod_security", "kubernetes_pod_refused", False),
    ("service_account", "kubernetes_pod_refused", False),
    ("rbac", "kubernetes_forbidden", False),
])
@pytest.mark.double_only("injects each admission plugin's and RBAC's 403 text into the double")
def test_a_403_on_create_says_which_refusal_it_is(cluster, runner, kind: str, code: str, retryable: bool):
    cluster.double.api.fail("POST", rf"/namespaces/{NS}/pods$", 403, times=10, message=REAL_403[kind])
    with pytest.raises(DriverPodFailure) as info:
        runner("pass").start(context())
    assert (info.value.error_code, info.value.retryable) == (code, retryable)
    assert REAL_403[kind] in str(info.value)  # what is full, or what policy refused, in the error
    assert cluster.pods() == []


@pytest.mark.service  # the cluster's kubelet runs pods as processes
def test_a_full_quota_fails_the_try_for_a_retry_which_creates_the_pod_once_it_frees(cluster, runner):
    """The API server's quota admission (the double's, or a real one), not an injected answer: a
    namespace allowed one pod, that pod running; the shard's try fails retryable naming what is
    full; once the pod ends the quota frees, and the retry's pod is created and runs."""
    cluster.create("resourcequotas", {"metadata": {"name": "batch-quota"},
                                      "spec": {"hard": {"pods": "1", "requests.memory": "64Gi"}}})
    cluster.wait_for(lambda: cluster.quota_counted("batch-quota"), 10, "the quota counted")
    sleeper = runner("import time; time.sleep(300)")
    blocker = ApiClient().sanitize_for_serialization(sleeper.pod_request(context()))
    blocker["metadata"].update(name="someone-elses-pod", labels={"app": "other"})
    cluster.create("pods", blocker)
    cluster.wait_for(cluster.running, 30, "the other pod running")
    with pytest.raises(DriverPodFailure) as info:
        runner("pass").start(context())
    assert (info.value.error_code, info.value.retryable) == ("kubernetes_quota_exceeded", True)
    assert "exceeded quota: batch-quota, requested: pods=1, used: pods=1, limited: pods=1" in str(info.value)
    assert [p["metadata"]["name"] for p in cluster.pods()] == ["someone-elses-pod"]
    cluster.end_pod("someone-elses-pod")
    cluster.wait_for(lambda: cluster.pod("someone-elses-pod")["status"]["phase"] == "Failed", 30,
                     "the other pod ended")
    cluster.wait_for(lambda: cluster.quota_counted("batch-quota", {"pods": "0"}), 10, "the quota freed")
    retry = deferred(runner("pass", try_number=2).start, context(2))
    assert len(cluster.pods()) == 2
    assert fire(retry.trigger)["status"] == "success"


@pytest.mark.service  # the cluster's kubelet runs pods as processes
def test_an_unpullable_image_fails_at_once_naming_it(cluster, runner):
    r = runner("pass")
    r.spec = dataclasses.replace(r.spec, image="registry.invalid/driver:nope")
    event = fire(deferred(r.start, context()).trigger)
    assert event["status"] in ("error", "failed", "timeout")
    verdict = runner("").finish(context(), event)
    assert verdict.failure.error_code == "driver_image_pull_failed" and not verdict.failure.retryable
    assert "registry.invalid/driver:nope" in str(verdict.failure)
    assert cluster.pods() == []


def _ref(name: str, namespace: str):
    from kubernetes.client import models as k8s

    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, namespace=namespace))

