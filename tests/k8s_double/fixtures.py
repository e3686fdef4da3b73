"""Pytest fixtures for the Kubernetes double (import ``fake_cluster`` into a conftest or test module)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.k8s_double.cluster import FakeCluster
from tests.k8s_double.kubelet import Image

# The image name tests use for "a Python image with this repo installed": runs this venv's python.
LOCAL_PYTHON_IMAGE = "local/python:test"


@pytest.fixture
def fake_cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    images = {LOCAL_PYTHON_IMAGE: Image({"python": sys.executable})}
    with FakeCluster(tmp_path / "k8s", images=images) as cluster:
        yield cluster
