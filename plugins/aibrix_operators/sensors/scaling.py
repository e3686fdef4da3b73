"""The serving roles around a batch: bring them up, scale them while shards run, bring them down.

Thin Airflow classes over ``aibrix_operators.scaling`` (policy, actuator, progress).
They act only with ``execution_mode="kubernetes"`` and when the deployment configured
roles (``[aibrix_scaling] roles``); otherwise ``roles_ready`` succeeds at once (so the
dispatch tasks after it run as before) and ``autoscale`` / ``scale_down`` skip.

* ``RolesReadySensor``: applies the policy's first decision (the deadline floor for the
  whole batch), then defers to ``RolesReadyTrigger`` until every role has at least one
  ready pod group.
* ``AutoscaleSensor``: beside the dispatch tasks; it decides once at its start (scraping
  the load itself), then every ``interval_s`` (at least ``MIN_INTERVAL_S``) the
  ``AutoscaleTickTrigger`` wakes it with a fresh scrape of each role's vLLM ``/metrics``
  (running / waiting requests, KV cache usage); it reads the drivers' progress, decides
  per role, applies the changes, logs each decision (one JSON line), pushes the last
  ``KEEP_DECISIONS`` per role as XCom ``scaling_decisions`` and sets the metrics; then
  defers again, carrying its state (recommendation history, learnt capacities, progress
  cursor, the last decisions: all bounded) in the deferral's kwargs. Ends when every
  shard is done, when every dispatch task instance has finished (a shard failed for good
  never completes), or when the completion window is over. A failing API call is logged
  and retried at the next tick; a permanent one (403, 404) fails the task, which never
  fails the batch (merge does not depend on it).
* ``ScaleDownOperator``: ``trigger_rule="all_done"``: leaves each role at its
  ``idle_replicas``, whatever happened to the batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from aibrix_operators.batch.job import ValidatedBatch, work_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.hooks.batch_storage import UsesBatchStorage
from aibrix_operators.scaling import metrics
from aibrix_operators.scaling.kube import RoleScaler, ScalingError
from aibrix_operators.scaling.load import RoleLoad
from aibrix_operators.scaling.policy import (
    RemainingWork,
    RoleObservation,
    RoleState,
    ScaleDecision,
    decide,
)
from aibrix_operators.scaling.progress import ProgressTracker, RequestProfile, sample_profile
from aibrix_operators.settings.role_scaling import ScalingSettings, load_scaling_settings, sync_api_client
from aibrix_operators.triggers.scaling import AutoscaleTickTrigger, RolesReadyTrigger, scrape_load

log = logging.getLogger(__name__)
DECISIONS_KEY = "scaling_decisions"
KEEP_DECISIONS = 10  # per role, in the XCom and the deferral's state
# The shortest wait between ticks. A deferred task that resumes before the executor has
# reported the end of its previous run is marked failed by the scheduler ("finished
# although the task says it's running": same try number); on a loaded worker that report
# took 5 s here. Decisions every 10 s are far finer than any role's start-up anyway.
MIN_INTERVAL_S = 10.0
# Dispatch task states after which that shard will not make progress any more.
FINISHED = ("success", "failed", "upstream_failed", "skipped", "removed")
# Permanent answers: retrying at the next tick cannot help.
PERMANENT = (403, 404)


def _active_settings(execution_mode: str) -> ScalingSettings | None:
    if execution_mode != "kubernetes":
        return None
    settings = load_scaling_settings()
    return settings if settings.roles else None


def _apply(scaler: RoleScaler, settings: ScalingSettings, decisions: dict[str, ScaleDecision],
           batch_id: str) -> None:
    for role, d in decisions.items():
        log.info("scaling decision %s", json.dumps({"batch_id": batch_id, **d.as_dict()}, default=str))
        metrics.record(d, batch_id)
        if d.changed:
            scaler.scale(settings.roles[role].target, d.desired_replicas)


class RolesReadySensor(UsesBatchStorage, BaseOperator):
    template_fields: Sequence[str] = ("validated", "execution_mode", "aws_conn_id")

    def __init__(self, *, validated: Any, execution_mode: str = "local", aws_conn_id: str | None = None,
                 poll_interval_s: float = 10.0, timeout_s: float = 1800.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validated = validated
        self.execution_mode = execution_mode
        self.aws_conn_id = aws_conn_id
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s

    def execute(self, context: Context) -> dict[str, Any]:
        settings = _active_settings(self.execution_mode)
        if settings is None:
            # Succeed (not skip): the dispatch tasks downstream must run as before.
            log.info("execution_mode=%s or no [aibrix_scaling] roles: nothing to bring up",
                     self.execution_mode)
            return {"scaled": False}
        batch = ValidatedBatch.from_dict(self.validated)
        storage = self.hook.storage_for(batch.input_uri)
        profile = sample_profile(storage, batch.input_uri)
        work = RemainingWork(batch.total_requests, batch.total_requests * profile.prompt_tokens,
                             batch.total_requests * profile.max_tokens)
        scaler = RoleScaler(sync_api_client(settings.kubernetes_conn_id))
        now = time.time()
        decisions = {}
        for role, rs in settings.roles.items():
            current = scaler.replicas(rs.target)
            decisions[role] = decide(rs.policy, work, RoleObservation(current.spec, current.ready),
                                     now, batch.expires_at)
        _apply(scaler, settings, decisions, batch.batch_id)
        want = {role: max(rs.policy.gang_size, 1) for role, rs in settings.roles.items()}
        self.defer(
            trigger=RolesReadyTrigger(
                targets=[rs.target.__dict__ for rs in settings.roles.values()], want=want,
                kubernetes_conn_id=settings.kubernetes_conn_id, poll_interval_s=self.poll_interval_s,
                timeout_s=self.timeout_s),
            method_name="execute_complete",
        )
        raise AssertionError("defer() raises")  # pragma: no cover

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "ready":
            raise AirflowException(f"serving roles not ready: {event.get('message')}")
        log.info("serving roles ready: %s", event["ready"])
        return {"scaled": True, "ready": event["ready"]}


class AutoscaleSensor(UsesBatchStorage, BaseOperator):
    template_fields: Sequence[str] = ("validated", "shards", "execution_mode", "aws_conn_id")

    def __init__(self, *, validated: Any, shards: Any, execution_mode: str = "local",
                 aws_conn_id: str | None = None, interval_s: float | None = None,
                 dispatch_task_id: str | None = "dispatch", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validated = validated
        self.shards = shards
        self.execution_mode = execution_mode
        self.aws_conn_id = aws_conn_id
        self.interval_s = interval_s
        self.dispatch_task_id = dispatch_task_id

    def execute(self, context: Context) -> dict[str, Any]:
        settings = _active_settings(self.execution_mode)
        if settings is None:
            raise AirflowSkipException(f"execution_mode={self.execution_mode} or no [aibrix_scaling] roles")
        # The first decision is made here, with a scrape of its own: deferring for it at once
        # would resume the task before the executor has reported this run's end, which the
        # scheduler takes for a task killed externally (see MIN_INTERVAL_S).
        load = asyncio.run(scrape_load(_sources(settings), settings.kubernetes_conn_id))
        return self.tick(context, event={"status": "tick", "load": load}, state={})

    def tick(
        self, context: Context, event: Any = None, state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        settings = _active_settings(self.execution_mode)
        if settings is None:
            raise AirflowSkipException(f"execution_mode={self.execution_mode} or no [aibrix_scaling] roles")
        batch = ValidatedBatch.from_dict(self.validated)
        shards = [ShardSpec.from_dict(s) for s in self.shards]
        storage = self.hook.storage_for(batch.input_uri)
        state = dict(state or {})
        if "profile" not in state:
            state["profile"] = sample_profile(storage, batch.input_uri).__dict__
        profile = RequestProfile(**state["profile"])
        run_id = _run_id(context)
        work_uri = work_prefix(batch.output_uri, run_id)
        tracker = ProgressTracker(storage, work_uri, shards, state.get("progress"))
        progress = tracker.poll()
        now = time.time()
        state["progress"] = tracker.state()
        # Throughput per role over the last interval, from the answers' usage.
        last = state.get("last") or {}
        rates: dict[str, float | None] = {"prompt_tokens": None, "output_tokens": None}
        if last and now > last["at"]:
            rates["prompt_tokens"] = (progress.prompt_tokens - last["prompt"]) / (now - last["at"])
            rates["output_tokens"] = (progress.completion_tokens - last["completion"]) / (now - last["at"])
        state["last"] = {"at": now, "prompt": progress.prompt_tokens,
                         "completion": progress.completion_tokens}
        why = self._end_reason(context, progress.done, len(shards), now > batch.expires_at)
        if why:
            log.info("autoscale ends: %s (%d/%d answered)", why, progress.answered, progress.total)
            return {"ended": why, "answered": progress.answered, "total": progress.total}

        work = progress.remaining(profile)
        load = ((event or {}).get("load") or {}) if isinstance(event, dict) else {}
        roles_state = state.get("roles") or {}
        history = state.get("decisions") or {}
        scaler = RoleScaler(sync_api_client(settings.kubernetes_conn_id))
        decisions: dict[str, ScaleDecision] = {}
        try:
            for role, rs in settings.roles.items():
                current = scaler.replicas(rs.target)
                seen = RoleLoad.from_dict(load.get(role))
                if seen.error or seen.unreachable:
                    log.warning("role %s load: %d pods answered, %d did not%s", role, seen.pods,
                                seen.unreachable, f"; {seen.error}" if seen.error else "")
                obs = RoleObservation(current.spec, current.ready, rates[rs.policy.work],
                                      running=seen.running, waiting=seen.waiting, kv_usage=seen.kv_usage)
                decisions[role] = decide(rs.policy, work, obs, now, batch.expires_at,
                                         RoleState.from_dict(roles_state.get(role)))
            _apply(scaler, settings, decisions, batch.batch_id)
        except ScalingError as exc:
            if exc.status in PERMANENT:
                raise AirflowException(f"autoscale: {exc}") from exc
            log.warning("autoscale: %s; trying again in %ss", exc, self._interval(settings))
        for role, d in decisions.items():
            roles_state[role] = d.state.as_dict()
            # Bounded: the deferral carries its state at every tick. Older decisions are in
            # the task log (one JSON line each) and the decision metrics only.
            history[role] = ([*history.get(role, []), d.as_dict()])[-KEEP_DECISIONS:]
        state["roles"], state["decisions"] = roles_state, history
        context["ti"].xcom_push(key=DECISIONS_KEY, value=history)
        if settings.pushgateway:
            from prometheus_client import push_to_gateway

            push_to_gateway(settings.pushgateway, job="aibrix_batch_autoscale", registry=metrics.REGISTRY)
        self._defer(settings, state, delay_s=self._interval(settings))
        raise AssertionError("defer() raises")  # pragma: no cover

    def _end_reason(self, context: Context, all_answered: bool, shards: int, expired: bool) -> str | None:
        """Why the autoscaler stops now, or None to go on."""
        if all_answered:
            return "every shard is done"
        if self.dispatch_task_id and shards:
            # A shard whose dispatch failed for good never completes: stop once every
            # dispatch task instance is finished, whatever its state (up_for_retry is not).
            ti = context["ti"]
            run_ids = [_run_id(context)]
            finished = ti.get_ti_count(dag_id=ti.dag_id, task_ids=[self.dispatch_task_id],
                                       run_ids=run_ids, states=list(FINISHED))
            if finished >= shards:
                failed = ti.get_ti_count(dag_id=ti.dag_id, task_ids=[self.dispatch_task_id],
                                         run_ids=run_ids, states=["failed", "upstream_failed"])
                return f"every dispatch task has finished ({failed} of {shards} failed)"
        if expired:
            return "the completion window is over"
        return None

    def _defer(self, settings: ScalingSettings, state: dict[str, Any], delay_s: float) -> None:
        self.defer(
            trigger=AutoscaleTickTrigger(
                moment=time.time() + delay_s, kubernetes_conn_id=settings.kubernetes_conn_id,
                sources=_sources(settings)),
            method_name="tick", kwargs={"state": state})

    def _interval(self, settings: ScalingSettings) -> float:
        interval = self.interval_s if self.interval_s is not None else settings.interval_s
        if interval < MIN_INTERVAL_S:
            log.warning("autoscale interval %ss raised to %ss", interval, MIN_INTERVAL_S)
        return max(interval, MIN_INTERVAL_S)


def _sources(settings: ScalingSettings) -> list[dict[str, Any]]:
    return [rs.metrics.__dict__ for rs in settings.roles.values()]


def _run_id(context: Context) -> str:
    return context["run_id"] if "run_id" in context else context["dag_run"].run_id


class ScaleDownOperator(BaseOperator):
    template_fields: Sequence[str] = ("execution_mode",)

    def __init__(self, *, execution_mode: str = "local", **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.execution_mode = execution_mode

    def execute(self, context: Context) -> dict[str, int]:
        settings = _active_settings(self.execution_mode)
        if settings is None:
            raise AirflowSkipException(f"execution_mode={self.execution_mode} or no [aibrix_scaling] roles")
        scaler = RoleScaler(sync_api_client(settings.kubernetes_conn_id))
        before: dict[str, int] = {}
        failed: list[str] = []
        for role, rs in settings.roles.items():  # every role, even if one fails
            try:
                before[role] = scaler.scale(rs.target, rs.idle_replicas)
                log.info("scale down %s: %d -> %d", rs.target.describe(), before[role], rs.idle_replicas)
            except ScalingError as exc:
                failed.append(f"{role}: {exc}")
        if failed:
            raise AirflowException("scale down failed for " + "; ".join(failed))
        return before
