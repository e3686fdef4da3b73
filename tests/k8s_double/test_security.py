"""The fake kubelet runs a container as a node would: the pod's securityContext and limits.

The driver pod's own spec (driver_pods/spec.py) says it runs as uid 65532, with a read-only root,
no capabilities and a memory limit; on a real node that is enforced, so here too (a driver that
wrote to its image's disk would pass against a kubelet that ignored it and fail in a cluster).
"""

from __future__ import annotations

import pytest
from kubernetes import client, config

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver_pods.spec import DriverPodRequest, DriverPodSettings, build_driver_pod
from tests.k8s_double.fixtures import LOCAL_PYTHON_IMAGE, container_cluster  # noqa: F401 - fixture
from tests.k8s_double.security import ContainerConfigError, podman_flags

NS = "batch"
NOW = 1_800_000_000.0
REQ = DriverPodRequest(batch_id="batch_0a750e3a913c42cf", shard_index=0, shard_uri="s3://b/shard-00000.jsonl",
                       results_prefix="s3://b/results/shard-00000", total_requests=10, attempt=1,
                       config=DriverConfig(endpoint="http://router:8000", deadline=NOW + 3600))
# What the pod prints: its ids, its effective capabilities, and whether it could write anywhere.
PROBE = (
    "import os\n"
    "caps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]\n"
    "def can_write(path):\n"
    "    try:\n"
    "        open(path, 'w').close()\n"
    "        return 'rw'\n"
    "    except OSError:\n"
    "        return 'ro'\n"
    "print(os.getuid(), os.getgid(), caps, can_write('/tmp/x'), can_write('/x'), flush=True)\n"
)


def driver_spec_pod(name: str, code: str, **limits: str) -> dict:
    """A pod with the driver pod's own security contexts (and ``limits``), running ``code``."""
    manifest = build_driver_pod(DriverPodSettings(), REQ, now=NOW).manifest()
    container = {"name": "driver", "image": LOCAL_PYTHON_IMAGE, "command": ["python", "-c", code],
                 "securityContext": manifest["spec"]["containers"][0]["securityContext"]}
    if limits:
        container["resources"] = {"limits": limits}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "securityContext": manifest["spec"]["securityContext"],
                     "containers": [container]}}


def test_the_driver_pods_spec_becomes_podmans_flags() -> None:
    manifest = build_driver_pod(DriverPodSettings(), REQ, now=NOW).manifest()
    flags = podman_flags(manifest, manifest["spec"]["containers"][0], image_user="65532:65532")
    assert flags == [
        "--user", "65532:65532",
        "--read-only", "--read-only-tmpfs=false",
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--memory", str(1 << 30), "--memory-swap", str(1 << 30),
    ]  # fmt: skip
    # A container's own runAsUser overrides the pod's.
    manifest["spec"]["containers"][0]["securityContext"]["runAsUser"] = 1001
    assert podman_flags(manifest, manifest["spec"]["containers"][0], "")[:2] == ["--user", "1001:65532"]


def test_run_as_non_root_is_refused_with_the_kubelets_message() -> None:
    pod = {"metadata": {"name": "p", "namespace": NS, "uid": "u"},
           "spec": {"securityContext": {"runAsNonRoot": True}, "containers": [{"name": "c"}]}}
    refused = r"image will run as root \(pod: \"p_batch\(u\)\", container: c\)"
    with pytest.raises(ContainerConfigError, match=refused):
        podman_flags(pod, pod["spec"]["containers"][0], image_user="")
    with pytest.raises(ContainerConfigError, match="non-numeric user \\(app\\)"):
        podman_flags(pod, pod["spec"]["containers"][0], image_user="app")
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 0}
    with pytest.raises(ContainerConfigError, match="runAsUser breaks non-root policy"):
        podman_flags(pod, pod["spec"]["containers"][0], image_user="65532")
    del pod["spec"]["containers"][0]["securityContext"]
    assert podman_flags(pod, pod["spec"]["containers"][0], image_user="65532:65532") == []


@pytest.mark.service
def test_a_container_runs_with_its_security_context_and_memory_limit(container_cluster) -> None:  # noqa: F811
    api = client.CoreV1Api(config.new_client_from_config(str(container_cluster.kubeconfig)))

    def finished(name: str) -> client.V1Pod:
        return container_cluster.wait_for(
            lambda: (p := api.read_namespaced_pod(name, NS)).status.phase in ("Succeeded", "Failed") and p,
            60, f"{name} to finish",
        )  # fmt: skip

    api.create_namespaced_pod(NS, driver_spec_pod("sec-1", PROBE))
    assert finished("sec-1").status.phase == "Succeeded"
    log = api.read_namespaced_pod_log("sec-1", NS, _preload_content=False).data.decode().split()
    # uid/gid 65532, no capabilities, nothing writable: not even /tmp (Kubernetes mounts no tmpfs).
    assert log == ["65532", "65532", "0000000000000000", "ro", "ro"]

    # Past its memory limit the cgroup kills it, and the kubelet says so.
    api.create_namespaced_pod(NS, driver_spec_pod("oom-1", "x = bytearray(512 << 20)", memory="128Mi"))
    term = finished("oom-1").status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (137, "OOMKilled")
    # Under it, the same allocation runs.
    api.create_namespaced_pod(NS, driver_spec_pod("fits-1", "x = bytearray(512 << 20)", memory="1Gi"))
    assert finished("fits-1").status.phase == "Succeeded"

    bad = driver_spec_pod("root-1", "pass")
    bad["spec"]["containers"][0]["securityContext"]["runAsUser"] = 0
    api.create_namespaced_pod(NS, bad)
    waiting = container_cluster.wait_for(
        lambda: (s := api.read_namespaced_pod("root-1", NS).status.container_statuses) and s[0].state.waiting,
        20, "root-1 refused",
    )  # fmt: skip
    assert waiting.reason == "CreateContainerConfigError"
    assert "runAsUser breaks non-root policy" in waiting.message
