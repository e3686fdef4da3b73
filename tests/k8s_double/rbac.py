"""RBAC authorization, as the kube-apiserver's RBAC authorizer decides a request.

``Authorizer.from_manifests`` takes rendered manifests (``kubectl kustomize k8s/overlays/...``)
and one ServiceAccount, and keeps the rules of the Roles its RoleBindings grant it in their
namespace. Each request is turned into what RBAC checks — verb (get, list, watch, create,
update, patch, delete, deletecollection), API group, resource (``pods``, ``pods/log``,
``statefulsets/scale``), name, namespace — and refused with the API server's own 403 text when
no rule allows it:

    pods "NAME" is forbidden: User "system:serviceaccount:NS:SA" cannot delete resource "pods"
    in API group "" in the namespace "NS"

So a test run against the double with ``ApiServerDouble.rbac`` set checks that the Roles we ship
grant every call the code makes (and the code's reading of a refusal).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_CORE = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/)?(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
_GROUP = re.compile(
    r"^/apis/(?P<group>[^/]+)/[^/]+/(?:namespaces/(?P<ns>[^/]+)/)?(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


@dataclass(frozen=True)
class Attributes:
    """What the RBAC authorizer decides on."""

    verb: str
    group: str
    resource: str  # with its subresource: "pods/log"
    name: str | None
    namespace: str | None


def attributes(method: str, path: str, query: dict[str, str]) -> Attributes | None:
    """The request's RBAC attributes; None for non-resource paths (``/version``)."""
    m = _CORE.match(path) or _GROUP.match(path)
    if not m:
        return None
    name, sub = m["name"], m["sub"]
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in ("true", "1", "True") else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())  # fmt: skip
    resource = f"{m['plural']}/{sub}" if sub else m["plural"]
    return Attributes(verb, m.groupdict().get("group") or "", resource, name, m["ns"])


@dataclass
class Authorizer:
    user: str
    namespace: str
    rules: list[dict[str, Any]]

    @classmethod
    def from_manifests(
        cls, docs: Iterable[dict[str, Any]], service_account: str, namespace: str
    ) -> Authorizer:
        """The rules the RoleBindings in ``docs`` grant ``service_account`` in ``namespace``."""
        docs = list(docs)
        roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role"}
        rules: list[dict[str, Any]] = []
        for binding in (d for d in docs if d["kind"] == "RoleBinding"):
            subjects = binding.get("subjects") or []
            if any(s.get("kind") == "ServiceAccount" and s.get("name") == service_account for s in subjects):
                rules += roles[binding["roleRef"]["name"]]["rules"]
        return cls(f"system:serviceaccount:{namespace}:{service_account}", namespace, rules)

    def allows(self, a: Attributes) -> bool:
        if a.namespace != self.namespace:  # Roles grant nothing at the cluster scope or elsewhere
            return False
        return any(
            a.group in rule.get("apiGroups", []) and a.resource in rule.get("resources", [])
            and a.verb in rule.get("verbs", [])
            and (not rule.get("resourceNames") or a.name in rule["resourceNames"])
            for rule in self.rules
        )  # fmt: skip

    def refusal(self, a: Attributes) -> str:
        plural = a.resource.split("/")[0]
        what = f'{plural} "{a.name}"' if a.name else plural
        where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
        return (f'{what} is forbidden: User "{self.user}" cannot {a.verb} resource "{a.resource}" '
                f'in API group "{a.group}" {where}')  # fmt: skip
