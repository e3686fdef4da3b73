"""Fixtures of the scaling tests: the Kubernetes API double with the scale subresource."""

from tests.scaling.k8s_scaling_double import scaling_cluster

__all__ = ["scaling_cluster"]
