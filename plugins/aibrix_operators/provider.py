"""What Airflow's Providers page lists for this package (the ``apache_airflow_provider`` entry
point): ``pip install`` into an existing Airflow registers the ``aibrix_batch`` connection type,
its hook, the batch operator and its trigger."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

PACKAGE = "aibrix-airflow-batch"
INTEGRATION = "AIBrix Batch API"


def get_provider_info() -> dict[str, Any]:
    try:
        versions = [version(PACKAGE)]
    except PackageNotFoundError:  # imported from a checkout that was never installed
        versions = []
    return {
        "package-name": PACKAGE,
        "name": "AIBrix batch inference",
        "description": "Offline LLM batch inference on vLLM through an OpenAI-compatible Batch API: "
                       "a deferrable operator for any DAG, its connection type and trigger.",
        "integrations": [{"integration-name": INTEGRATION, "tags": ["ai"],
                          "external-doc-url": "https://platform.openai.com/docs/api-reference/batch"}],
        "operators": [{"integration-name": INTEGRATION,
                       "python-modules": ["aibrix_operators.operators.batch_api"]}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["aibrix_operators.hooks.batch_api"]}],
        "triggers": [{"integration-name": INTEGRATION,
                      "python-modules": ["aibrix_operators.triggers.batch_api"]}],
        "connection-types": [{"connection-type": "aibrix_batch",
                              "hook-class-name": "aibrix_operators.hooks.batch_api.BatchApiHook",
                              "hook-name": "AIBrix Batch API (OpenAI-compatible)"}],
        "versions": versions,
    }
