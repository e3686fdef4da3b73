"""Run one shard's requests: the step that is swappable between execution modes.

``execution_mode="local"`` runs the batch driver inside the Airflow worker.
``"kubernetes"`` runs the same driver (``python -m aibrix_operators.driver.cli``) in a
pod (``operators/driver_pod.py``: the provider's hook, pod manager and ``KubernetesPodTrigger``,
no ``KubernetesPodOperator``), deferred while the pod runs (no worker slot held);
validation, splitting and merging do not change, because the driver reads its shard from
and writes its results to the same URIs in both modes. See docs/dispatch.md.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from aibrix_operators.batch.error_codes import CodedFailure
from aibrix_operators.batch.job import ValidatedBatch, cancel_marker_uri, work_prefix
from aibrix_operators.batch.job_pool import JobPool
from aibrix_operators.batch.shard_results import results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.batch.stop_rules import StopRules, stop_prefix
from aibrix_operators.batch_api.batches import API_CONF_KEY
from aibrix_operators.batch_api.tenant_salt import CLAIM_KEY, salt_for_run
from aibrix_operators.batch_api.tenant_salt import VARIABLE as SALT_KEY_VARIABLE
from aibrix_operators.driver.batch_shard import run_shard_of_batch
from aibrix_operators.driver.cache_salt import check_cache_salt
from aibrix_operators.driver.config import DEFAULT_ENDPOINT_WAIT_S, DriverConfig, default
from aibrix_operators.driver.preflight import ModelNotServed, check_endpoint
from aibrix_operators.driver_pods.outcome import DriverPodFailure
from aibrix_operators.driver_pods.spec import DriverPodRequest, DriverPodSettings, build_driver_pod
from aibrix_operators.hooks.batch_storage import UsesBatchStorage
from aibrix_operators.lora.registry import AdapterRegistryError
from aibrix_operators.lora.serving import AdapterLoadFailed, ensure_adapter
from aibrix_operators.operators.batch_metrics import shard_finished
from aibrix_operators.operators.memory import release_freed_memory
from aibrix_operators.operators.step_errors import records_step_error
from aibrix_operators.router.admin import AdminConfigError
from aibrix_operators.scheduling.shard_turns import wait_for_turn
from aibrix_operators.settings.capacity import capacity_for
from aibrix_operators.settings.driver_pods import load_driver_pod_settings
from aibrix_operators.settings.job_pool import load_job_pool_limits
from aibrix_operators.settings.lora import adapter_cache_dir, load_adapter_registry, router_admin_token
from aibrix_operators.storage import Storage
from aibrix_operators.trust.deployment import load_policy, resolve_inference
from aibrix_operators.trust.policy import TrustViolation

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

        # The worker's heap (Airflow, the DAG, the task runner) is long-lived: frozen, the
        # collector's full passes during the shard do not walk it again and again. Without this
        # a shard ran ~1.5x slower inside `airflow dags test` than in a bare process
        # (bench/dag_at_scale.py); unfrozen afterwards, so the worker's memory is as before.
        gc.freeze()
        try:
            return asyncio.run(preflight_then_run())
        except ModelNotServed as exc:
            raise_failure(exc)
        finally:
            gc.unfreeze()
            release_freed_memory()


class KubernetesShardExecutor:
    """Runs the driver CLI in a pod (``DriverPodRunner``), deferring while it runs.

    ``start`` raises ``TaskDeferred`` (or returns the trigger-like event of a reattached pod that
    has already finished); ``finish`` turns the pod's end into the task's XCom (the driver's
    outcome) or a failure that says whether a retry can help.
    """

    def __init__(self, settings: DriverPodSettings, log: Any = None) -> None:
        self.settings = settings
        self.log = log
        self.runner: Any = None  # the DriverPodRunner of the current call (on_kill deletes its pod)

    def pod_runner(self, request: DriverPodRequest):  # -> DriverPodRunner
        from aibrix_operators.operators.driver_pod import DriverPodRunner  # the provider loads only here

        self.runner = DriverPodRunner(pod=build_driver_pod(self.settings, request), settings=self.settings,
                                      log=self.log)
        return self.runner

    def start(self, context: Context, request: DriverPodRequest) -> dict[str, Any] | None:
        runner = self.pod_runner(request)
        pod = runner.spec
        runner.log.info("driver pod %s in namespace %s, image %s, labels %s", pod.name, pod.namespace,
                        pod.image, pod.labels)
        return _raise_for(runner.start, context)

    def finish(self, context: Context, request: DriverPodRequest, event: dict[str, Any]) -> dict[str, Any]:
        verdict = _raise_for(self.pod_runner(request).finish, context, event)
        if verdict.failure is not None:
            raise_failure(verdict.failure)
        assert verdict.outcome is not None
        return verdict.outcome

    def on_kill(self) -> None:
        if self.runner is not None:
            self.runner.on_kill()


def _raise_for(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except DriverPodFailure as failure:
        raise_failure(failure)


def raise_failure(failure: CodedFailure) -> NoReturn:
    """Retryable failures get Airflow's retries; the others fail the task at once (the failure
    says which: ``CodedFailure.retryable``)."""
    kind = AirflowException if failure.retryable else AirflowFailException
    raise kind(str(failure)) from failure


def executor_for(mode: str, endpoint_wait_s: float = 0.0) -> ShardExecutor:
    if mode == "local":
        return LocalShardExecutor(endpoint_wait_s)
    raise AirflowFailException(f"execution_mode {mode!r} is not one of {EXECUTION_MODES}")


class DispatchShardOperator(UsesBatchStorage, BaseOperator):
    """Send one shard's requests to an OpenAI-compatible endpoint; map it over shards.

    Runs the driver in the worker (``execution_mode="local"``) or in a driver pod, deferring
    while it runs (``"kubernetes"``). A retry resumes from the shard's checkpoints.

    :param shard: One shard descriptor of the split task's output (the mapped argument). (templated)
    :param validated: The validate task's output. (templated)
    :param endpoint: Base URL of the inference server; checked against the allow-list. (templated)
    :param concurrency: Requests in flight. (templated)
    :param max_attempts: Attempts per request on 408/429/5xx/timeouts. (templated)
    :param request_timeout_s: Per-request timeout, seconds. (templated)
    :param execution_mode: ``local`` or ``kubernetes``. (templated)
    :param aws_conn_id: Airflow connection for ``s3://`` URIs. (templated)
    :param endpoint_wait_s: How long to wait for a starting endpoint. (templated)
    :param inference_conn_id: Airflow connection of the inference server (host and key). (templated)
    :param outage_budget_s: How long an endpoint that answers nothing is waited out. (templated)
    :param kubernetes_namespace: Driver pods' namespace; empty: the deployment's. (templated)
    :param kubernetes_service_account: Driver pods' service account; empty: the deployment's.
        (templated)
    :param cache_salt: vLLM ``cache_salt`` on every generation request, sent as ``param:<salt>``; a
        Batch API run's salt is derived from the claim in its conf instead. (templated)
    :param capacity_mode: Empty (the deployment's mode for the endpoint), ``shared`` or ``dedicated``;
        only a restatement of ``[aibrix_batch] shared_endpoints`` (docs/shared-capacity.md). (templated)
    :param max_workers: Shards of this batch dispatched at once; empty: no cap of the batch's own
        (``scheduling/shard_turns.py``). (templated)
    :param memory_per_job: kubernetes mode: the driver pod's memory request and limit; empty: the
        deployment's ``driver_memory_*``. (templated)
    """

    template_fields: Sequence[str] = (
        "shard", "validated", "endpoint", "concurrency", "max_attempts", "request_timeout_s",
        "execution_mode", "aws_conn_id", "endpoint_wait_s", "inference_conn_id", "outage_budget_s",
        "kubernetes_namespace", "kubernetes_service_account", "cache_salt", "capacity_mode",
        "max_workers", "memory_per_job",
    )

    def __init__(
        self,
        *,
        shard: Any,
        validated: Any,
        endpoint: str | None = None,
        concurrency: int = default("concurrency"),
        max_attempts: int = default("max_attempts"),
        request_timeout_s: float = default("request_timeout_s"),
        execution_mode: str = "local",
        endpoint_wait_s: float = DEFAULT_ENDPOINT_WAIT_S,
        outage_budget_s: float = default("outage_budget_s"),
        inference_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        kubernetes_namespace: str | None = None,
        kubernetes_service_account: str | None = None,
        cache_salt: str | None = None,
        capacity_mode: str | None = None,
        max_workers: int | None = None,
        memory_per_job: str | None = None,
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
        self.kubernetes_namespace = kubernetes_namespace
        self.kubernetes_service_account = kubernetes_service_account
        self.cache_salt = cache_salt
        self.capacity_mode = capacity_mode
        self.max_workers = max_workers
        self.memory_per_job = memory_per_job

    def execute(self, context: Context) -> dict[str, Any]:
        # Before anything else, and outside records_step_error: a shard waiting for its turn
        # (a reschedule) has not failed.
        wait_for_turn(context["ti"], int(self.max_workers) if self.max_workers else None)
        return self._dispatch(context)

    @records_step_error("dispatch")
    def _dispatch(self, context: Context) -> dict[str, Any]:
        if self.execution_mode == "kubernetes":
            request = self._pod_request(context)
            self._prepare_pod_adapter()
            # Defers (raises TaskDeferred) unless a reattached pod has already finished.
            event = self._kubernetes().start(context, request)
            assert event is not None
            return self._finish_pod(context, request, event)
        shard = ShardSpec.from_dict(self.shard)
        batch = ValidatedBatch.from_dict(self.validated)
        target, cache_salt, capacity = self._where_requests_go(context)
        try:
            # The worker's own environment never supplies a key (api_key_env=None): a key
            # comes only from the inference connection and is bound to its host.
            config = self._driver_config(target.endpoint, batch, cache_salt, capacity, api_key_env=None,
                                         api_key=target.api_key, api_key_origin=target.api_key_origin)
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from exc
        prepare_adapter(shard, config, float(self.endpoint_wait_s))
        storage = self.hook.storage_for(shard.uri)
        work = work_prefix(batch.output_uri, context["run_id"])
        executor = executor_for(self.execution_mode, float(self.endpoint_wait_s))
        outcome = executor.run(storage, shard, work, config, batch.model)
        shard_finished(context, batch.batch_id)
        return outcome

    def _prepare_pod_adapter(self) -> None:
        """kubernetes mode: the shard's LoRA adapter is loaded from the worker before the pod
        starts, as in local mode (the pod's driver only sends requests)."""
        shard = ShardSpec.from_dict(self.shard)
        if not shard.adapter:
            return
        try:
            target = resolve_inference(load_policy(), self.endpoint or None, self.inference_conn_id)
        except TrustViolation as exc:
            raise AirflowFailException(str(exc)) from exc
        config = DriverConfig(endpoint=target.endpoint, api_key_env=None, api_key=target.api_key,
                              api_key_origin=target.api_key_origin)
        prepare_adapter(shard, config, float(self.endpoint_wait_s))

    @records_step_error("dispatch")
    def trigger_reentry(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after the driver pod's ``KubernetesPodTrigger`` fired (``DriverPodRunner`` defers
        to this name, the one the provider's operator used, so a task deferred by an older version
        of this package resumes here too)."""
        return self._finish_pod(context, self._pod_request(context), event)

    def _finish_pod(
        self, context: Context, request: DriverPodRequest, event: dict[str, Any]
    ) -> dict[str, Any]:
        outcome = self._kubernetes().finish(context, request, event)
        shard_finished(context, request.batch_id)
        self.log.info("shard %s: %s completed, %s failed (pod outcome)", request.shard_index,
                      outcome.get("completed"), outcome.get("failed"))
        return outcome

    def _kubernetes(self) -> KubernetesShardExecutor:
        self._pod_executor = KubernetesShardExecutor(self._pod_settings(), self.log)
        return self._pod_executor

    def on_kill(self) -> None:
        """Killed while creating or finishing a pod: delete it (while deferred, the trigger's
        ``on_kill_action`` does)."""
        executor = getattr(self, "_pod_executor", None)
        if executor is not None:
            executor.on_kill()

    def _where_requests_go(self, context: Context) -> tuple[Any, str | None, Any]:
        """The inference target, this run's cache salt and the endpoint's capacity mode, for both
        execution modes. The target is checked again here, not only in validate: this is where
        the requests leave."""
        try:
            target = resolve_inference(load_policy(), self.endpoint or None, self.inference_conn_id)
            capacity = capacity_for(target.endpoint, self.capacity_mode or None)
            return target, self._batch_salt(context), capacity
        except (ValueError, TrustViolation) as exc:
            raise AirflowFailException(str(exc)) from exc

    def _batch_salt(self, context: Context) -> str | None:
        """This run's salt: the tenant's, from a Batch API claim that verifies for this run id,
        else the ``cache_salt`` param in a namespace of its own (batch_api/tenant_salt.py).
        Raises ``ValueError`` for a claim that does not verify: a copied conf fails the task."""
        conf = getattr(context.get("dag_run"), "conf", None) or {}
        api = conf.get(API_CONF_KEY) if isinstance(conf, dict) else None
        claim = api.get(CLAIM_KEY) if isinstance(api, dict) else None
        return salt_for_run(context["run_id"], claim, check_cache_salt(self.cache_salt or None), _salt_key)

    def _pod_settings(self) -> DriverPodSettings:
        return load_driver_pod_settings()

    def _pod_request(self, context: Context) -> DriverPodRequest:
        """The same request on start and on resume: built from the task's (re-rendered) fields."""
        shard = ShardSpec.from_dict(self.shard)
        batch = ValidatedBatch.from_dict(self.validated)
        target, cache_salt, capacity = self._where_requests_go(context)
        memory = self.memory_per_job or None
        try:
            if memory is not None:  # checked again where it is used, as in validate
                JobPool(memory_per_job=memory).check(load_job_pool_limits())
        except (ValueError, TrustViolation) as exc:
            raise AirflowFailException(str(exc)) from exc
        if target.api_key:
            # The pod's key is the deployment's inference Secret (bound to its own origin): a
            # connection's password never goes into a pod spec.
            self.log.info("execution_mode=kubernetes: the pod gets the API key of the inference Secret, "
                          "not the password of connection %r", self.inference_conn_id)
        work = work_prefix(batch.output_uri, context["run_id"])
        if not shard.uri.startswith("s3://"):
            self.log.warning("shard %s is a local path: a driver pod sees it only if it mounts the same "
                             "file system at the same path", shard.uri)
        try:
            # Namespace and service account: the trigger's choice only among the deployment's.
            settings = self._pod_settings()
            namespace = settings.choose_namespace(self.kubernetes_namespace or None)
            service_account = settings.choose_service_account(self.kubernetes_service_account or None)
        except TrustViolation as exc:
            raise AirflowFailException(str(exc)) from exc
        try:
            # The same DriverConfig as a worker run, less the key (the pod's comes from its Secret).
            config = self._driver_config(target.endpoint, batch, cache_salt, capacity,
                                         cancel_uri=cancel_marker_uri(work),
                                         stop_prefix=stop_prefix(work)).for_pod()
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from exc
        return DriverPodRequest(
            batch_id=batch.batch_id, shard_index=shard.index, shard_uri=shard.uri,
            results_prefix=results_prefix(work, shard.name), total_requests=shard.num_requests,
            attempt=int(context["ti"].try_number), config=config, model=batch.model,
            endpoint_wait_s=float(self.endpoint_wait_s), namespace=namespace,
            service_account=service_account, memory=memory,
        )

    def _driver_config(
        self, endpoint: str, batch: ValidatedBatch, cache_salt: str | None, capacity: Any, **more: Any
    ) -> DriverConfig:
        """The shard's driver settings from this task's fields: one place for both execution modes."""
        return DriverConfig(
            endpoint=endpoint, concurrency=int(self.concurrency), max_attempts=int(self.max_attempts),
            request_timeout_s=float(self.request_timeout_s), outage_budget_s=float(self.outage_budget_s),
            deadline=float(batch.expires_at), cache_salt=cache_salt, capacity=capacity,
            stop_rules=StopRules.from_dict(batch.stop_rules) if batch.stop_rules else None, **more,
        )


def prepare_adapter(shard: ShardSpec, config: DriverConfig, endpoint_wait_s: float) -> None:
    """The shard's LoRA adapter fetched, verified and loaded on its server (lora/serving.py).

    The server is waited for as the driver's preflight waits (``endpoint_wait_s``); a server that
    stays away is an outage (``endpoint_unavailable``, retried like one), while a bad adapter
    fails the task with the adapter's name (a retry cannot fix a wrong digest)."""
    if not shard.adapter:
        return

    async def ready_then_load() -> None:
        await check_endpoint(config, None, endpoint_wait_s)
        await ensure_adapter(config.base_url, config.headers(), adapter, adapter_cache_dir(),
                             admin_token=admin_token)

    try:
        adapter = load_adapter_registry().get(shard.adapter)
        admin_token = router_admin_token()
        asyncio.run(ready_then_load())
    except (AdapterLoadFailed, AdapterRegistryError, AdminConfigError) as exc:
        raise AirflowFailException(f"{shard.name}: {exc}") from exc


def _salt_key() -> bytes | None:
    """The key of the Batch API's salt claims, read only for a run that carries one."""
    from airflow.sdk import Variable

    try:
        value = Variable.get(SALT_KEY_VARIABLE, default=None)
    except Exception:  # noqa: BLE001 - unreadable is reported as missing, by name, in the task's error
        return None
    return str(value).encode() if value else None
