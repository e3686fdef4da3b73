"""The submitter's side of the Batch API: ``BatchClient`` (Python) and the ``aibrix-batch`` CLI.

Modules: ``batch_client`` (the client over the official SDK), ``cli`` (the verbs),
``progress`` (bars, rate, ETA), ``profile`` (base URL and key: flag > env > profile file),
``errors`` (one-line errors and exit codes). No Airflow import: a submitter installs nothing
of the orchestrator.
"""

from __future__ import annotations

from typing import Any

from aibrix_operators.client.errors import BatchNotDone, ClientError, ConfigError, ExitCode, InputFileError

__all__ = ["TERMINAL", "BatchClient", "BatchNotDone", "ClientError", "ConfigError", "ExitCode",
           "InputFileError"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the openai SDK takes ~2 s to import here, which `aibrix-batch
    # --help` and a usage error should not wait for.
    if name in ("BatchClient", "TERMINAL"):
        from aibrix_operators.client import batch_client

        return getattr(batch_client, name)
    raise AttributeError(name)
