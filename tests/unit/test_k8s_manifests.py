"""The shipped Kubernetes manifests are valid for current Kubernetes API versions (strict)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"


def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                docs.append((f"{path.relative_to(K8S)}#{i}", doc))
    return docs


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_manifests_validate_strictly(version):
    found = manifests()
    assert found, "no manifests under k8s/"
    for name, doc in found:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name} invalid for Kubernetes {version}: {exc.message}") from exc


def test_kustomization_lists_every_base_manifest():
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk
