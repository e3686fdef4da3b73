"""The double against the real ``kubernetes`` and ``kubernetes_asyncio`` clients."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes_asyncio import client as aclient
from kubernetes_asyncio import config as aconfig

from tests.k8s_double.api import field_selector_matches, label_selector_matches
from tests.k8s_double.fixtures import LOCAL_PYTHON_IMAGE, fake_cluster, process_cluster  # noqa: F401 - fixture

NS = "batch"


def core(cluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))


def pod(name: str, code: str, env: list | None = None, image: str = LOCAL_PYTHON_IMAGE, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "t", "shard": name[-1]}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "base", "image": image, "command": ["python", "-c", code], "env": env or []}
            ],
            **spec,
        },
    }


def wait_phase(api: client.CoreV1Api, name: str, phases: tuple[str, ...], cluster) -> client.V1Pod:
    return cluster.wait_for(
        lambda: (p := api.read_namespaced_pod(name, NS)).status.phase in phases and p,
        20,
        f"{name} in {phases}",
    )


def test_selectors() -> None:
    labels = {"a": "1", "b": "2"}
    assert label_selector_matches("a=1,b==2", labels)
    assert not label_selector_matches("a=1,b!=2", labels)
    assert label_selector_matches("a in (0, 1),!c", labels)
    assert not label_selector_matches("a notin (1),b", labels)
    assert not label_selector_matches("c", labels)
    assert field_selector_matches("involvedObject.name=x", {"involvedObject": {"name": "x"}})
    assert not field_selector_matches("involvedObject.name=x", {"involvedObject": {"name": "y"}})


@pytest.mark.service
def test_pod_runs_with_secret_env_and_reports_logs_and_exit_code(fake_cluster) -> None:  # noqa: F811
    api = core(fake_cluster)
    fake_cluster.add_secret(NS, "creds", {"TOKEN": "s3cr3t-value"})
    env = [
        {"name": "LIT", "value": "plain"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "TOKEN"}}},
        {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}}},
    ]
    code = (
        "import os,sys; print(os.environ['LIT'], len(os.environ['TOKEN']), 'OPT' in os.environ,"
        " 'PYTEST_CURRENT_TEST' in os.environ, os.getcwd(), *sys.argv[1:], flush=True);"
        " print('err', file=sys.stderr);"
        " sys.exit(3)"
    )
    manifest = pod("p-1", code, env)
    manifest["spec"]["containers"][0].update(workingDir="/tmp", args=["one", "two"])
    api.create_namespaced_pod(NS, manifest)
    done = wait_phase(api, "p-1", ("Failed",), fake_cluster)
    term = done.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (3, "Error")
    # (kubernetes 36's sync client returns str(bytes) for text bodies unless the raw response is read)
    logs = api.read_namespaced_pod_log("p-1", NS, container="base", _preload_content=False).data.decode()
    # nothing leaks from the test process; args reach the program after the command
    assert logs.splitlines() == ["plain 12 False False /tmp one two", "err"]
    tail = api.read_namespaced_pod_log("p-1", NS, tail_lines=1, _preload_content=False).data.decode()
    assert tail == "err\n"
    reasons = [
        e.reason for e in api.list_namespaced_event(NS, field_selector="involvedObject.name=p-1").items
    ]
    assert reasons[:2] == ["Scheduled", "Pulled"] and "Started" in reasons


@pytest.mark.service
def test_list_watch_patch_delete_and_faults(fake_cluster) -> None:  # noqa: F811
    api = core(fake_cluster)
    # Exits 143 on SIGTERM: in a container it is PID 1, which the kernel shields from signals it
    # has no handler for (the driver CLI installs one for the same reason).
    sigterm_aware = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143));"
                     " print('ready', flush=True); time.sleep(30)")
    api.create_namespaced_pod(NS, pod("w-1", sigterm_aware))
    api.create_namespaced_pod(NS, pod("w-2", "pass"))
    assert [p.metadata.name for p in api.list_namespaced_pod(NS, label_selector="app=t,shard=1").items] == [
        "w-1"
    ]
    with pytest.raises(ApiException) as conflict:
        api.create_namespaced_pod(NS, pod("w-1", "pass"))
    assert conflict.value.status == 409
    wait_phase(api, "w-1", ("Running",), fake_cluster)
    fake_cluster.wait_for(  # its SIGTERM handler is in place (a container takes a moment to start)
        lambda: "ready" in api.read_namespaced_pod_log("w-1", NS, _preload_content=False).data.decode(),
        30, "w-1 ready",
    )
    api.patch_namespaced_pod("w-1", NS, {"metadata": {"labels": {"checked": "True"}}})
    assert api.read_namespaced_pod("w-1", NS).metadata.labels["checked"] == "True"
    seen = []
    # The loop ends at DELETED. 2 s (as it was) is less than a loaded machine may take to stop a
    # container gracefully (docs/testing.md, flake log); not much more, since the double serves a
    # watch to its timeout after the client leaves and its teardown waits for that (30 s timed out).
    events = watch.Watch().stream(api.list_namespaced_pod, NS, label_selector="shard=1", timeout_seconds=6)
    for event in events:
        seen.append(event["type"])
        if event["type"] == "ADDED":
            api.delete_namespaced_pod("w-1", NS, grace_period_seconds=1)
        if event["type"] == "DELETED":
            break
    events.close()  # closes the watch's connection now, not when the generator is collected
    assert seen[0] == "ADDED" and seen[-1] == "DELETED" and "MODIFIED" in seen, seen
    run = fake_cluster.kubelet.run_of(NS, "w-1")
    assert run.exit_code == 128 + 15  # SIGTERM from the graceful delete

    fault = fake_cluster.api.fail("GET", r"/pods/w-2$", 500, times=1)
    with pytest.raises(ApiException) as failed:
        api.read_namespaced_pod("w-2", NS)
    assert failed.value.status == 500 and fault.hits == 1
    assert api.read_namespaced_pod("w-2", NS).metadata.name == "w-2"
    bad = client.CoreV1Api(client.ApiClient(client.Configuration(host=fake_cluster.url)))
    with pytest.raises(ApiException) as unauth:
        bad.read_namespaced_pod("w-2", NS)
    assert unauth.value.status == 401


@pytest.mark.service
def test_node_failures_image_unschedulable_evicted_deadline(fake_cluster) -> None:  # noqa: F811
    api = core(fake_cluster)
    api.create_namespaced_pod(NS, pod("i-1", "pass", image="registry.invalid/none:1"))
    p = fake_cluster.wait_for(
        lambda: (x := api.read_namespaced_pod("i-1", NS)).status.container_statuses and x, 10, "image pull"
    )
    assert p.status.container_statuses[0].state.waiting.reason == "ErrImagePull"
    with pytest.raises(ApiException) as waiting:
        api.read_namespaced_pod_log("i-1", NS)
    assert waiting.value.status == 400

    api.create_namespaced_pod(NS, pod("d-1", "import time; time.sleep(30)", activeDeadlineSeconds=1))
    p = wait_phase(api, "d-1", ("Failed",), fake_cluster)
    assert p.status.reason == "DeadlineExceeded"

    api.create_namespaced_pod(NS, pod("e-1", "import time; time.sleep(30)"))
    wait_phase(api, "e-1", ("Running",), fake_cluster)
    fake_cluster.kubelet.evict(NS, "e-1")
    p = wait_phase(api, "e-1", ("Failed",), fake_cluster)
    assert p.status.reason == "Evicted"

    fake_cluster.kubelet.schedulable = False
    api.create_namespaced_pod(NS, pod("u-1", "pass"))
    p = fake_cluster.wait_for(
        lambda: (x := api.read_namespaced_pod("u-1", NS)).status.conditions and x, 10, "cond"
    )
    assert (p.status.phase, p.status.conditions[0].reason) == ("Pending", "Unschedulable")
    fake_cluster.kubelet.schedulable = True
    wait_phase(api, "u-1", ("Succeeded",), fake_cluster)


@pytest.mark.service
def test_async_client_reads_and_watch_can_stall(fake_cluster) -> None:  # noqa: F811
    api = core(fake_cluster)
    api.create_namespaced_pod(NS, pod("a-1", "print('hello')"))
    wait_phase(api, "a-1", ("Succeeded",), fake_cluster)
    fake_cluster.api.stall_watches(r"events.*watch=true")

    async def main() -> tuple[str, int]:
        cfg = aclient.Configuration()
        await aconfig.load_kube_config(config_file=str(fake_cluster.kubeconfig), client_configuration=cfg)
        async with aclient.ApiClient(cfg) as ac:
            v1 = aclient.CoreV1Api(ac)
            got = await v1.read_namespaced_pod("a-1", NS)
            logs = await v1.read_namespaced_pod_log("a-1", NS, timestamps=True)
            from kubernetes_asyncio import watch as awatch

            n = 0
            async for _ in awatch.Watch().stream(v1.list_namespaced_event, NS, timeout_seconds=1):
                n += 1
            return got.status.phase + "|" + logs.split(" ", 1)[1].strip(), n

    phase_logs, events = asyncio.run(main())
    assert phase_logs == "Succeeded|hello" and events == 0


def test_the_quota_admission_answers_as_the_api_server_does() -> None:
    from tests.k8s_double.quota import QuotaExceeded, admit_pod

    def pod(memory: str, phase: str = "Running") -> dict:
        limits = {"memory": memory, "cpu": "500m"}
        return {"spec": {"containers": [{"resources": {"limits": limits}}]}, "status": {"phase": phase}}

    hard = {"limits.memory": "4Gi", "limits.cpu": "4"}
    quota = {"metadata": {"name": "batch-quota"}, "spec": {"hard": hard}}
    running = [pod("2Gi"), pod("2048Mi"), pod("8Gi", phase="Succeeded")]  # a finished pod counts nothing
    with pytest.raises(QuotaExceeded) as info:
        admit_pod([quota], running, "aibrix-driver-x", pod("1Gi"))
    # The kube-apiserver's text (the one tests/unit/test_driver_pod_runner.py's REAL_403 quotes).
    assert str(info.value) == ('pods "aibrix-driver-x" is forbidden: exceeded quota: batch-quota, requested: '
                               "limits.memory=1Gi, used: limits.memory=4Gi, limited: limits.memory=4Gi")
    admit_pod([quota], running[1:], "aibrix-driver-x", pod("1Gi"))  # 2Gi + 1Gi fits


@pytest.mark.service
def test_a_write_with_a_stale_resource_version_is_a_conflict(fake_cluster) -> None:  # noqa: F811
    api = core(fake_cluster)
    fake_cluster.api.store.create("/api/v1/configmaps", NS, {"metadata": {"name": "c"}, "data": {"k": "1"}})
    read = api.read_namespaced_config_map("c", NS)
    api.patch_namespaced_config_map("c", NS, {"data": {"k": "2"}})  # someone else writes meanwhile
    with pytest.raises(ApiException) as info:
        stale = {"metadata": {"resourceVersion": read.metadata.resource_version}, "data": {"k": "3"}}
        api.patch_namespaced_config_map("c", NS, stale)
    assert info.value.status == 409 and "the object has been modified" in info.value.body
    fresh = api.read_namespaced_config_map("c", NS)
    current = {"metadata": {"resourceVersion": fresh.metadata.resource_version}, "data": {"k": "3"}}
    api.patch_namespaced_config_map("c", NS, current)
    assert api.read_namespaced_config_map("c", NS).data == {"k": "3"}


@pytest.mark.service
def test_a_watch_from_a_compacted_resource_version_is_gone(process_cluster) -> None:  # noqa: F811
    """As the API server after etcd compacted: the watch answers ERROR 410 Expired in its stream
    (the client raises it), and a fresh list gives a version to watch from again."""
    api = core(process_cluster)
    store = process_cluster.api.store
    store.create("/api/v1/configmaps", NS, {"metadata": {"name": "a"}, "data": {}})
    old = api.list_namespaced_config_map(NS).metadata.resource_version
    store.create("/api/v1/configmaps", NS, {"metadata": {"name": "b"}, "data": {}})
    store.compact()
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(api.list_namespaced_config_map, NS, resource_version=old,
                                      timeout_seconds=2):
            pass
    assert gone.value.status == 410 and "too old resource version" in str(gone.value)
    fresh = api.list_namespaced_config_map(NS).metadata.resource_version
    store.create("/api/v1/configmaps", NS, {"metadata": {"name": "c"}, "data": {}})
    events = [(e["type"], e["object"].metadata.name) for e in watch.Watch().stream(
        api.list_namespaced_config_map, NS, resource_version=fresh, timeout_seconds=1)]
    assert events == [("ADDED", "c")]
