"""What a pod's securityContext and limits make of its container, as a node's runtime applies them.

The fake kubelet runs a container-mode pod with podman; this module turns the pod's spec into
podman's flags, so a container runs as it would on a real node:

* ``runAsUser`` / ``runAsGroup`` (the container's over the pod's) → ``--user``;
* ``runAsNonRoot``: the kubelet's own check before it creates the container — a root user (by
  ``runAsUser`` or, without one, the image's ``USER``) is a ``CreateContainerConfigError`` with
  the kubelet's message, and nothing starts;
* ``readOnlyRootFilesystem`` → ``--read-only`` without podman's writable ``/tmp`` (Kubernetes
  mounts no tmpfs: only volumes are writable, and the double models none);
* ``capabilities.drop`` / ``add`` → ``--cap-drop`` / ``--cap-add``; ``allowPrivilegeEscalation:
  false`` → ``no-new-privileges``; ``privileged``; ``seccompProfile: Unconfined``;
* ``limits.memory`` → ``--memory`` with no swap above it (the cgroup kills the container at the
  limit; the kubelet reports ``OOMKilled``, from conmon's ``oom`` file: podman.py), ``limits.cpu``
  → ``--cpus``.

Process-mode pods (a local Python) get none of this: ``fake_cluster`` runs the double's tests in
both modes, and the driver-pod DAG tests run the real image in container mode.
"""

from __future__ import annotations

import functools
import subprocess
from typing import Any

from tests.k8s_double.quota import quantity

Obj = dict[str, Any]

# The pod-level fields a container's own securityContext overrides (the rest are container-only).
_INHERITED = ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")


class ContainerConfigError(Exception):
    """The kubelet refuses to create the container (the pod waits as CreateContainerConfigError)."""


def effective_context(pod: Obj, container: Obj) -> Obj:
    """The container's securityContext with what it does not set taken from the pod's."""
    pod_ctx = pod["spec"].get("securityContext") or {}
    ctx = {key: pod_ctx[key] for key in _INHERITED if key in pod_ctx}
    ctx.update(container.get("securityContext") or {})
    return ctx


def podman_flags(pod: Obj, container: Obj, image_user: str) -> list[str]:
    """podman run flags for ``container`` of ``pod``; ContainerConfigError where the kubelet
    would not start it. ``image_user`` is the image's ``USER`` (``""``: root)."""
    ctx = effective_context(pod, container)
    flags: list[str] = []
    image_uid, _, image_gid = image_user.partition(":")
    uid = ctx.get("runAsUser")
    if ctx.get("runAsNonRoot"):
        _check_non_root(pod, container, uid, image_uid)
    if uid is not None or ctx.get("runAsGroup") is not None:
        user = str(uid) if uid is not None else (image_uid or "0")
        group = ctx.get("runAsGroup")
        flags += ["--user", f"{user}:{group}" if group is not None else user]
    if ctx.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]
    caps = ctx.get("capabilities") or {}
    for cap in caps.get("drop") or []:
        flags += ["--cap-drop", cap]
    for cap in caps.get("add") or []:
        flags += ["--cap-add", cap]
    if ctx.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    if ctx.get("privileged"):
        flags += ["--privileged"]
    if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
        flags += ["--security-opt", "seccomp=unconfined"]
    limits = (container.get("resources") or {}).get("limits") or {}
    if "memory" in limits:
        memory = str(int(quantity(limits["memory"])))
        flags += ["--memory", memory, "--memory-swap", memory]  # swap = memory: none above the limit
    if "cpu" in limits:
        flags += ["--cpus", str(quantity(limits["cpu"]))]
    return flags


def _check_non_root(pod: Obj, container: Obj, uid: Any, image_uid: str) -> None:
    """The kubelet's verifyRunAsNonRoot, with its messages
    (pkg/kubelet/kuberuntime/security_context_others.go)."""
    meta = pod["metadata"]
    pod_ref = f'{meta["name"]}_{meta.get("namespace", "")}({meta.get("uid", "")})'
    where = f'(pod: "{pod_ref}", container: {container["name"]})'
    if uid is not None:
        if int(uid) == 0:
            raise ContainerConfigError(f"container's runAsUser breaks non-root policy {where}")
        return
    if not image_uid.isdigit() and image_uid not in ("", "root"):
        raise ContainerConfigError(
            f"container has runAsNonRoot and image has non-numeric user ({image_uid}), cannot verify user "
            f"is non-root {where}"
        )
    if image_uid in ("", "root") or int(image_uid) == 0:
        raise ContainerConfigError(f"container has runAsNonRoot and image will run as root {where}")


@functools.cache
def image_user(podman: tuple[str, ...], image: str) -> str:
    """The image's ``USER`` (``""`` when it sets none: root)."""
    out = subprocess.run(
        [*podman, "image", "inspect", "--format", "{{.Config.User}}", image],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()
