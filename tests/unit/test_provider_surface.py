"""The cncf-kubernetes provider's surface that kubernetes-mode dispatch uses: pinned, public only.

``operators/driver_pod.py`` runs driver pods with the provider's hook, pod manager and
``KubernetesPodTrigger`` and no ``KubernetesPodOperator`` (docs/dispatch.md). This test fails
when the provider version moves off the pin in requirements.txt, when a name, parameter or event
status the package relies on changes, when the package starts using a provider member this file
does not pin, or when it touches anything private of the provider's (or imports its operator).
"""

from __future__ import annotations

import ast
import datetime
import importlib
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins" / "aibrix_operators"
RUNNER = PLUGINS / "operators" / "driver_pod.py"
DISPATCH = (RUNNER, PLUGINS / "operators" / "dispatch.py")  # kubernetes-mode dispatch
PROVIDER = "airflow.providers.cncf.kubernetes"

# Every provider name the package imports, and for classes every member it uses with the
# parameters it passes (None: an attribute, not called with keywords here).
SURFACE: dict[str, dict[str, list[str] | None]] = {
    f"{PROVIDER}.hooks.kubernetes:KubernetesHook": {
        "__init__": ["conn_id"],
        "core_v1_client": None,
        "get_pod_logs": ["pod_name", "container", "namespace"],
    },
    f"{PROVIDER}.utils.pod_manager:PodManager": {
        "__init__": ["kube_client"],
        "create_pod": ["pod"],
        "read_pod": ["pod"],
        "await_pod_completion": ["pod", "container_name"],
        "read_pod_events": ["pod"],
        "delete_pod": ["pod"],
    },
    f"{PROVIDER}.utils.pod_manager:detect_pod_terminate_early_issues": {"__call__": ["pod"]},
    f"{PROVIDER}.triggers.pod:KubernetesPodTrigger": {"__init__": None, "serialize": [], "run": []},
    f"{PROVIDER}.kubernetes_helper_functions:generic_api_retry": {"__call__": ["func"]},
    f"{PROVIDER}.kubernetes_helper_functions:KubernetesApiException": {},
    f"{PROVIDER}.pod_generator:make_safe_label_value": {"__call__": ["string"]},
}
# The attributes through which driver_pod.py reaches the provider's objects, and what they are.
HANDLES = {
    "hook": f"{PROVIDER}.hooks.kubernetes:KubernetesHook",
    "pods": f"{PROVIDER}.utils.pod_manager:PodManager",
}


def resolve(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def pinned_provider_version() -> str:
    text = (REPO / "requirements.txt").read_text()
    m = re.search(r"^apache-airflow-providers-cncf-kubernetes==([\w.]+)\s*$", text, re.M)
    assert m, "requirements.txt must pin apache-airflow-providers-cncf-kubernetes exactly (==)"
    return m.group(1)


def test_the_provider_installed_is_the_pinned_one():
    assert version("apache-airflow-providers-cncf-kubernetes") == pinned_provider_version()


@pytest.mark.parametrize("ref", sorted(SURFACE))
def test_each_pinned_name_exists_with_the_parameters_passed(ref):
    obj = resolve(ref)
    for member, passed in SURFACE[ref].items():
        target = obj if member == "__call__" else getattr(obj, member, None)
        assert target is not None, f"{ref}.{member} is gone"
        name = getattr(target, "__name__", member)
        assert not name.startswith("_") or name.startswith("__"), f"{ref}.{member} is private"
        if passed:
            missing = set(passed) - params(target)
            assert not missing, f"{ref}.{member} lost the parameters {missing}"


def test_the_trigger_takes_every_argument_the_runner_passes_and_gives_them_back():
    from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger

    from aibrix_operators.driver_pods.spec import DriverPodSettings, build_driver_pod
    from aibrix_operators.operators.driver_pod import DriverPodRunner
    from tests.unit.test_driver_pods import NOW, REQ

    settings = DriverPodSettings(kubernetes_conn_id="no_such_connection_here")
    runner = DriverPodRunner(pod=build_driver_pod(settings, REQ, now=NOW), settings=settings)
    kwargs = runner.trigger_arguments("pod-x", "batch", redefers=2)
    unknown = set(kwargs) - params(KubernetesPodTrigger.__init__)
    assert not unknown, f"KubernetesPodTrigger no longer takes {unknown}"
    classpath, back = KubernetesPodTrigger(**kwargs).serialize()
    assert classpath == f"{PROVIDER}.triggers.pod.KubernetesPodTrigger"
    for key, value in kwargs.items():
        assert back[key] == value, key  # the triggerer rebuilds the trigger from exactly these
    assert isinstance(back["trigger_start_time"], datetime.datetime)


def test_the_trigger_emits_only_the_statuses_the_runner_handles():
    from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger

    from aibrix_operators.operators.driver_pod import TRIGGER_STATUSES

    source = inspect.getsource(KubernetesPodTrigger)
    emitted = set(re.findall(r'"status":\s*"(\w+)"', source))
    assert emitted == set(TRIGGER_STATUSES), emitted
    # Its events carry the pod's name and namespace, and the trigger_kwargs the runner counts in.
    assert source.count('"name": self.pod_name') >= len(emitted)
    assert "**self.trigger_kwargs" in source


def provider_imports(tree: ast.AST) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PROVIDER):
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith(PROVIDER)]
    return found


def test_the_package_never_uses_the_pod_operator_or_a_private_provider_name():
    for path in PLUGINS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        where = path.relative_to(REPO)
        for module, name in provider_imports(tree):
            assert not module.endswith(".operators.pod"), f"{where} imports {module}"
            assert not name.startswith("_") and not any(p.startswith("_") for p in module.split(".")), (
                f"{where} imports the private {module}:{name}"
            )
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.Attribute):
                ident = node.id if isinstance(node, ast.Name) else node.attr
                assert ident != "KubernetesPodOperator", f"{where} uses KubernetesPodOperator"


@pytest.mark.parametrize("path", DISPATCH, ids=lambda p: p.name)
def test_dispatch_imports_only_pinned_provider_names(path):
    pinned = {tuple(ref.split(":")) for ref in SURFACE}
    for module, name in provider_imports(ast.parse(path.read_text())):
        assert (module, name) in pinned, f"{path.name} imports {module}:{name}: pin it in SURFACE"


def test_the_runner_uses_only_pinned_members_and_nothing_private_of_anything_but_itself():
    tree = ast.parse(RUNNER.read_text())
    members = {handle: set(SURFACE[ref]) for handle, ref in HANDLES.items()}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        # self.hook.X / self.pods.X: X must be pinned.
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self":
            if base.attr in HANDLES:
                assert node.attr in members[base.attr], (
                    f"driver_pod.py line {node.lineno} uses {HANDLES[base.attr]}.{node.attr}: pin it"
                )
        # A leading underscore is private: allowed on the runner's own objects (self, cls) only.
        if node.attr.startswith("_") and not node.attr.startswith("__"):
            assert isinstance(base, ast.Name) and base.id in ("self", "cls"), (
                f"driver_pod.py line {node.lineno} reaches a private member: {ast.unparse(node)}"
            )
    # No inheritance from a provider class: nothing of theirs is overridden.
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert not node.bases, f"{node.name} subclasses {[ast.unparse(b) for b in node.bases]}"
