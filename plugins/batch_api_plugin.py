"""Airflow plugin: mounts the OpenAI-compatible Batch API at ``/openai`` in the api-server.

Clients point the official SDK at ``http://HOST:PORT/openai/v1``. The app is
built lazily on first request, so the plugin costs nothing in the scheduler
and workers, which also load plugins.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from aibrix_operators.batch_api.app import create_app
from aibrix_operators.batch_api.path_guard import ControlCharPathGuard
from aibrix_operators.batch_api.plugin_context import build_context

URL_PREFIX = "/openai"


class BatchApiPlugin(AirflowPlugin):
    name = "aibrix_batch_api"
    fastapi_apps = [{"app": create_app(build_context), "url_prefix": URL_PREFIX, "name": "OpenAI Batch API"}]
    # Paths the mount cannot match (control characters) get a 400 in OpenAI's shape.
    fastapi_root_middlewares = [{"middleware": ControlCharPathGuard, "kwargs": {"prefix": URL_PREFIX + "/"},
                                 "name": "OpenAI Batch API path guard"}]
