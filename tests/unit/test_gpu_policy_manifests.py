"""gpu_policy in the manifests: both overlays with either placement component render, every
object validates (built-ins strictly, StormService against the v0.5.0 CRD), and each vLLM pod
template carries exactly its policy's placement — the switch docs/job-pool.md describes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from aibrix_operators.batch.job_pool import GPU_POLICIES, JobPoolLimits
from tests.unit.test_k8s_manifests import K8S, OVERLAYS, assert_valid, kubectl

COMPONENT = "../../components/gpu-policy-{}"


def render_with(tmp_path: Path, overlay: str, policy: str) -> list[dict[str, Any]]:
    """The overlay as a deployment that chose ``policy`` would render it: its kustomization's
    component line switched, nothing else."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    kustomization = tree / "overlays" / overlay / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count(COMPONENT.format("spread")) == 1, "each overlay names one placement component"
    kustomization.write_text(text.replace(COMPONENT.format("spread"), COMPONENT.format(policy)))
    out = subprocess.run([kubectl(), "kustomize", str(tree / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def vllm_pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    specs = []
    for d in docs:
        if d["kind"] == "StatefulSet" and d["metadata"]["labels"].get("app.kubernetes.io/name") == "vllm":
            specs.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "StormService":
            specs += [r["template"]["spec"] for r in d["spec"]["template"]["spec"]["roles"]]
    return specs


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("policy", GPU_POLICIES)
@pytest.mark.service
def test_each_policy_renders_valid_manifests_with_its_placement(tmp_path: Path, overlay: str,
                                                                policy: str) -> None:
    docs = render_with(tmp_path, overlay, policy)
    for doc in docs:
        assert_valid(doc, f"{overlay}+{policy}: {doc['kind']}/{doc['metadata']['name']}", "1.33")
    specs = vllm_pod_specs(docs)
    assert len(specs) == (8 if overlay == "plain" else 2)  # 4 groups x 2 roles; 2 StormService roles
    for spec in specs:
        if policy == "pack":
            [term] = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            selector = term["podAffinityTerm"]["labelSelector"]
            assert selector == {"matchLabels": {"app.kubernetes.io/name": "vllm"}}
            assert "topologySpreadConstraints" not in spec
        else:
            [spread] = spec["topologySpreadConstraints"]
            assert (spread["maxSkew"], spread["topologyKey"]) == (1, "kubernetes.io/hostname")
            # peers are the pod's own role: prefill spreads among prefill, decode among decode
            assert spread["matchLabelKeys"] == ["app.kubernetes.io/component"]
            assert "affinity" not in spec
    # Nothing but vLLM pods is placed by the policy (the router and Redis keep their own).
    others = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
              and d["metadata"].get("labels", {}).get("app.kubernetes.io/name") != "vllm"]
    assert others and all("topologySpreadConstraints" not in s and "affinity" not in s for s in others)


def test_the_checked_in_overlays_place_as_the_default_setting_says() -> None:
    default = JobPoolLimits().gpu_policy
    for overlay in OVERLAYS:
        text = (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
        assert COMPONENT.format(default) in text, overlay
