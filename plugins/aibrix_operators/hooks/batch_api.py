"""The ``aibrix_batch`` connection: an OpenAI-compatible Batch API's base URL and key.

One connection type for this project's Batch API and for any service that speaks OpenAI's
Batch API (OpenAI itself included): the host is the base URL (``http://airflow:8080`` gets
``/openai/v1``, where this project's plugin mounts the API; a URL with a path is kept as given,
e.g. ``https://api.openai.com/v1``), the password is the API key. The key never leaves the
hook: operators and triggers hold the connection id only.
"""

from __future__ import annotations

from typing import Any

import openai
from airflow.sdk import BaseHook

from aibrix_operators.client.batch_client import BatchClient
from aibrix_operators.client.profile import normalize_base_url
from aibrix_operators.trust.policy import connection_url

DEFAULT_CONN_ID = "aibrix_batch_default"
CONN_TYPE = "aibrix_batch"


class BatchApiHook(BaseHook):
    """Clients for the Batch API that connection ``batch_conn_id`` names.

    :param batch_conn_id: an ``aibrix_batch`` connection: host = the API's base URL,
        password = its API key; the port and schema are read as Airflow's HTTP connections do.
    :param timeout_s: each HTTP call's timeout.
    """

    conn_name_attr = "batch_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = CONN_TYPE
    hook_name = "AIBrix Batch API (OpenAI-compatible)"

    def __init__(self, batch_conn_id: str = DEFAULT_CONN_ID, timeout_s: float = 60.0) -> None:
        super().__init__()
        self.batch_conn_id = batch_conn_id
        self.timeout_s = timeout_s

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["login", "extra"],
            "relabeling": {"host": "Base URL", "password": "API key", "schema": "Scheme"},
            "placeholders": {"host": "http://airflow-api-server:8080 or https://api.openai.com/v1",
                             "password": "sk-…"},
        }

    @staticmethod
    def _params(conn: Any) -> tuple[str, str]:
        if not conn.password:
            raise ValueError(f"connection {conn.conn_id!r} has no API key (its password field)")
        return normalize_base_url(connection_url(conn.host, conn.schema, conn.port)), conn.password

    def get_conn(self) -> BatchClient:
        base_url, key = self._params(self.get_connection(self.batch_conn_id))
        # Retries are the caller's: the operator re-attaches, the trigger polls again.
        return BatchClient(base_url, key, timeout=self.timeout_s, max_retries=0)

    async def get_async_conn(self) -> openai.AsyncOpenAI:
        """An SDK client for the triggerer's event loop (the connection read without blocking it)."""
        base_url, key = self._params(await self.aget_connection(self.batch_conn_id))
        return openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=self.timeout_s, max_retries=0)
