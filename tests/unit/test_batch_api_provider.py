"""The package as an Airflow provider: the Providers page lists it, and the ``aibrix_batch``
connection type resolves to its hook, whose base URL and key come from the connection."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aibrix_operators.hooks.batch_api import BatchApiHook


def test_airflow_discovers_the_provider_and_its_connection_type() -> None:
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "aibrix-airflow-batch" in manager.providers
    hook = manager.hooks["aibrix_batch"]
    assert hook is not None and hook.hook_class_name == "aibrix_operators.hooks.batch_api.BatchApiHook"
    assert (hook.package_name, hook.connection_id_attribute_name) == ("aibrix-airflow-batch", "batch_conn_id")
    info = manager.providers["aibrix-airflow-batch"].data
    assert info["operators"][0]["python-modules"] == ["aibrix_operators.operators.batch_api"]
    assert info["versions"]  # read from the installed package


def conn(**fields: object) -> SimpleNamespace:
    defaults = {"conn_id": "c", "host": None, "schema": None, "port": None, "password": "sk"}
    return SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize(("fields", "base_url"), [
    ({"host": "http://airflow:8080"}, "http://airflow:8080/openai/v1"),  # this project's API
    ({"host": "airflow", "port": 8080}, "http://airflow:8080/openai/v1"),
    ({"host": "https://api.openai.com/v1"}, "https://api.openai.com/v1"),  # a URL with a path: as given
    ({"host": "http://127.0.0.1/v1", "port": 9000}, "http://127.0.0.1:9000/v1"),
])
def test_the_connection_gives_the_base_url(fields: dict, base_url: str) -> None:
    assert BatchApiHook._params(conn(**fields)) == (base_url, "sk")


def test_a_connection_without_a_key_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="connection 'c' has no API key"):
        BatchApiHook._params(conn(host="http://airflow:8080", password=None))
