"""Pytest fixtures for the Kubernetes double (import them into a conftest or test module).

``fake_cluster`` runs each test twice: pods as real containers of the built batch-driver image
(podman), and pods as local processes. ``process_cluster`` is the process mode alone, for a test
that needs what containers here do not model (say so in the test); ``container_cluster`` the
container mode alone, for what only a container models (a security context, limits). Each of these
is the double itself: with ``K8S_TEST_KUBECONFIG`` set, a test taking one is deselected
(``target.DOUBLE_FIXTURES``). ``kube_target`` is the seam that switches: the double (process mode)
by default, the real cluster that variable names otherwise (``target.py``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.k8s_double.cluster import FakeCluster
from tests.k8s_double.kubelet import Image
from tests.k8s_double.target import KubeTarget, open_target

# The image name tests use for "a Python image with this repo installed".
LOCAL_PYTHON_IMAGE = "local/python:test"


@functools.cache
def driver_container_image() -> str:
    """The batch-driver image built from this checkout's Dockerfile (a cache hit after make images)."""
    from tests.images.containers import build

    return build("batch-driver")["tag"]


@pytest.fixture(params=["container", "process"])
def fake_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FakeCluster]:
    if request.param == "container":
        image = Image(container=driver_container_image())
    else:
        image = Image({"python": sys.executable})
    with FakeCluster(tmp_path / "k8s", images={LOCAL_PYTHON_IMAGE: image}) as cluster:
        yield cluster


@pytest.fixture
def container_cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    """Container mode alone: for what only a container models (security context, limits)."""
    images = {LOCAL_PYTHON_IMAGE: Image(container=driver_container_image())}
    with FakeCluster(tmp_path / "k8s", images=images) as cluster:
        yield cluster


@pytest.fixture
def process_cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    images = {LOCAL_PYTHON_IMAGE: Image({"python": sys.executable})}
    with FakeCluster(tmp_path / "k8s", images=images) as cluster:
        yield cluster


@pytest.fixture
def kube_target(tmp_path: Path) -> Iterator[KubeTarget]:
    """The Kubernetes API this test talks to: the double, or the cluster K8S_TEST_KUBECONFIG names."""
    with open_target(tmp_path) as target:
        yield target
