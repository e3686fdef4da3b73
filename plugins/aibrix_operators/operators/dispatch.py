"""Run one shard's requests: the step that is swappable between execution modes.

``execution_mode="local"`` runs the batch driver inside the Airflow worker.
``"kubernetes"`` (a later step of the roadmap) will run the same driver
(``python -m aibrix_operators.driver``) in a pod; validation, splitting and
merging do not change, because the driver reads its shard from and writes its
results to the same URIs in both modes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.batch.job import ValidatedBatch, run_shard_of_batch, work_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.preflight import ModelNotServed, check_endpoint
from aibrix_operators.hooks.batch_storage import BatchStorageHook
from aibrix_operators.hooks.trust import load_policy, resolve_inference
from aibrix_operators.operators.step_errors import records_step_error
from aibrix_operators.storage import Storage
from aibrix_operators.trust import TrustViolation

EXECUTION_MODES = ("local", "kubernetes")


class ShardExecutor(Protocol):
    def run(
        self, storage: Storage, shard: ShardSpec, work: str, config: DriverConfig, model: str | None
    ) -> dict[str, Any]: ...


class LocalShardExecutor:
    """Runs the driver in this process (the Airflow worker)."""

    def __init__(self, endpoint_wait_s: float = 0.0) -> None:
        self.endpoint_wait_s = endpoint_wait_s

    def run(
        self, storage: Storage, shard: ShardSpec, work: str, config: DriverConfig, model: str | None
    ) -> dict[str, Any]:
        async def preflight_then_run() -> dict[str, Any]:
            await check_endpoint(config, model, self.endpoint_wait_s)
            # The batch is in progress from its first request, not from the wait for a server.
            started = int(time.time())
            outcome = await run_shard_of_batch(storage, shard, work, config)
            return {**outcome.as_dict(), "started_at": started}

        try:
            return asyncio.run(preflight_then_run())
        except ModelNotServed as exc:
            raise AirflowFailException(str(exc)) from exc


def executor_for(mode: str, endpoint_wait_s: float = 0.0) -> ShardExecutor:
    if mode == "local":
        return LocalShardExecutor(endpoint_wait_s)
    if mode == "kubernetes":
        raise AirflowFailException(
            "execution_mode 'kubernetes' is not available in this release; use 'local' "
            "(see docs/dispatch.md for the seam it will use)"
        )
    raise AirflowFailException(f"execution_mode {mode!r} is not one of {EXECUTION_MODES}")


class DispatchShardOperator(BaseOperator):
    """Send one shard's requests to an OpenAI-compatible endpoint; map it over shards."""

    template_fields: Sequence[str] = (
        "shard", "validated", "endpoint", "concurrency", "max_attempts", "request_timeout_s",
        "execution_mode", "aws_conn_id", "endpoint_wait_s", "inference_conn_id", "outage_budget_s",
    )

    def __init__(
        self,
        *,
        shard: Any,
        validated: Any,
        endpoint: str | None = None,
        concurrency: int = 64,
        max_attempts: int = 5,
        request_timeout_s: float = 600.0,
        execution_mode: str = "local",
        endpoint_wait_s: float = 300.0,
        outage_budget_s: float = 900.0,
        inference_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shard = shard
        self.validated = validated
        self.endpoint = endpoint
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self.execution_mode = execution_mode
        self.endpoint_wait_s = endpoint_wait_s
        self.outage_budget_s = outage_budget_s
        self.inference_conn_id = inference_conn_id
        self.aws_conn_id = aws_conn_id

    @records_step_error("dispatch")
    def execute(self, context: Context) -> dict[str, Any]:
        shard = ShardSpec.from_dict(self.shard)
        batch = ValidatedBatch.from_dict(self.validated)
        try:
            # Checked again here, not only in validate: this is where the requests leave.
            target = resolve_inference(load_policy(), self.endpoint or None, self.inference_conn_id)
            # The worker's own environment never supplies a key (api_key_env=None): a key
            # comes only from the inference connection and is bound to its host.
            config = DriverConfig(
                endpoint=target.endpoint, concurrency=int(self.concurrency),
                max_attempts=int(self.max_attempts), request_timeout_s=float(self.request_timeout_s),
                deadline=float(batch.expires_at), api_key_env=None, api_key=target.api_key,
                api_key_origin=target.api_key_origin, outage_budget_s=float(self.outage_budget_s),
            )
        except (ValueError, TrustViolation) as exc:
            raise AirflowFailException(str(exc)) from exc
        storage = BatchStorageHook(self.aws_conn_id).storage_for(shard.uri)
        work = work_prefix(batch.output_uri, context["run_id"])
        executor = executor_for(self.execution_mode, float(self.endpoint_wait_s))
        return executor.run(storage, shard, work, config, batch.model)
