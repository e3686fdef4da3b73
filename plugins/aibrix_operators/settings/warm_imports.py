"""The pipeline's modules, imported once in the Airflow processes that fork a DAG parse per task.

Airflow 3 runs every task in a fresh fork that parses the task's DAG file first: forks of a
LocalExecutor worker (itself forked from the scheduler), of a Celery or an Edge worker, and the
dag-processor forks one per file it parses. What the parent has imported the fork inherits; what it
has not, every fork imports again. Parsing ``batch_inference`` imports the pipeline (aiohttp for the
driver, numpy for the grouped split) and, through its Asset, every provider's asset URI handlers —
the Amazon provider's S3 hook and boto3. That took 1.1-1.4 CPU-s per parse here, and 0.05 once the
parent had imported them (2026-12-07, a fork per DAG file; py-spy of one suite module: 96 task
processes spent 125 of their 177 CPU-s in that parse).

Airflow's own ``[dag_processor] parsing_pre_import_modules`` does this for ``airflow.*`` imports
only, in the dag-processor only. ``warm()`` runs from the deployment's ``airflow_local_settings.py``,
which every Airflow process imports at start; it imports only in the components that fork parses
(``FORKING_COMPONENTS``), so the api-server, the triggerer and one-off CLI commands start as before.
A module that fails to import is left to the parse, which reports it where Airflow reports import
errors.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

# `airflow <argv[1:]>` of the components whose task or parse processes are forks of their own.
FORKING_COMPONENTS: tuple[tuple[str, ...], ...] = (
    ("scheduler",), ("dag-processor",), ("celery", "worker"), ("edge", "worker"),
)

# What parsing the pipeline's DAG files imports beyond Airflow's own start: the module that builds
# their tasks (and with it the driver, the split, the S3 storage), and the S3 hook the Amazon
# provider's asset URI handler imports when a DAG declares an Asset.
MODULES: tuple[str, ...] = (
    "aibrix_operators.operators.pipeline",
    "airflow.providers.amazon.aws.hooks.s3",
)


def forks_dag_parses(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (``sys.argv`` of an ``airflow`` command) starts a component whose tasks or
    parses run in forks of it."""
    args = [a for a in argv[1:] if not a.startswith("-")]
    return any(tuple(args[: len(c)]) == c for c in FORKING_COMPONENTS)


def warm(argv: Sequence[str] | None = None) -> None:
    """Import ``MODULES`` if this process is a forking component."""
    if not forks_dag_parses(sys.argv if argv is None else argv):
        return
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the parse reports it where Airflow shows import errors
            log.warning("could not pre-import %s for the DAG parses: %s", name, exc)
