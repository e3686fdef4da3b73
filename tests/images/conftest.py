"""Fixtures of the image smoke tests: the images, built from this checkout's Dockerfiles."""

from __future__ import annotations

import pytest

from tests.driver.conftest import fault_server, make_request  # noqa: F401 - fixtures
from tests.images import containers
from tests.integration.conftest import s3_server, tiny_model  # noqa: F401 - fixtures


@pytest.fixture(scope="session")
def driver_image() -> str:
    return containers.build("batch-driver")["tag"]


@pytest.fixture(scope="session")
def router_image() -> str:
    return containers.build("router")["tag"]


@pytest.fixture(scope="session")
def airflow_image() -> str:
    return containers.build("airflow")["tag"]


@pytest.fixture(scope="session")
def vllm_cpu_image() -> str:
    return containers.build("vllm-cpu")["tag"]
