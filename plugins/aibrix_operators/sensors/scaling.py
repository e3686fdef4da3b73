"""The serving roles around a batch: bring them up, scale them while shards run, bring them down.

Thin Airflow classes over ``aibrix_operators.scaling`` (policy, actuator, progress).
They act only with ``execution_mode="kubernetes"`` and when the deployment configured
roles (``[aibrix_scaling] roles``); otherwise ``roles_ready`` succeeds at once (so the
dispatch tasks after it run as before) and ``autoscale`` / ``scale_down`` skip.

* ``RolesReadySensor``: applies the policy's first decision (the deadline floor for the
  whole batch), then defers to ``RolesReadyTrigger`` until every role has at least one
  ready pod group.
* ``AutoscaleSensor``: beside the dispatch tasks; every ``interval_s`` it reads the
  drivers' progress, decides per role, applies the changes, logs each decision (one JSON
  line), pushes the latest ones as XCom ``scaling_decisions`` and sets the metrics; then
  defers on a timer, carrying its state (recommendation history, learnt capacities,
  progress cursor) in the deferral's kwargs. Ends when every shard is done, or when the
  completion window is over. A failing API call is logged and retried at the next tick;
  a permanent one (403, 404) fails the task, which never fails the batch (merge does
  not depend on it).
* ``ScaleDownOperator``: ``trigger_rule="all_done"``: leaves each role at its
  ``idle_replicas``, whatever happened to the batch.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from aibrix_operators.batch.job import ValidatedBatch, work_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.hooks.batch_storage import BatchStorageHook
from aibrix_operators.hooks.role_scaling import ScalingSettings, load_scaling_settings, sync_api_client
from aibrix_operators.scaling import metrics
from aibrix_operators.scaling.kube import RoleScaler, ScalingError
from aibrix_operators.scaling.policy import (
    RemainingWork,
    RoleObservation,
    RoleState,
    ScaleDecision,
    decide,
)
from aibrix_operators.scaling.progress import ProgressTracker, RequestProfile, sample_profile
from aibrix_operators.triggers.scaling import RolesReadyTrigger

log = logging.getLogger(__name__)
DECISIONS_KEY = "scaling_decisions"
KEEP_DECISIONS = 20  # per role, in the XCom
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


class RolesReadySensor(BaseOperator):
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
        storage = BatchStorageHook(self.aws_conn_id or None).storage_for(batch.input_uri)
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


class AutoscaleSensor(BaseOperator):
    template_fields: Sequence[str] = ("validated", "shards", "execution_mode", "aws_conn_id")

    def __init__(self, *, validated: Any, shards: Any, execution_mode: str = "local",
                 aws_conn_id: str | None = None, interval_s: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validated = validated
        self.shards = shards
        self.execution_mode = execution_mode
        self.aws_conn_id = aws_conn_id
        self.interval_s = interval_s

    def execute(self, context: Context) -> dict[str, Any]:
        return self.tick(context)

    def tick(
        self, context: Context, event: Any = None, state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        settings = _active_settings(self.execution_mode)
        if settings is None:
            raise AirflowSkipException(f"execution_mode={self.execution_mode} or no [aibrix_scaling] roles")
        batch = ValidatedBatch.from_dict(self.validated)
        shards = [ShardSpec.from_dict(s) for s in self.shards]
        storage = BatchStorageHook(self.aws_conn_id or None).storage_for(batch.input_uri)
        state = dict(state or {})
        if "profile" not in state:
            state["profile"] = sample_profile(storage, batch.input_uri).__dict__
        profile = RequestProfile(**state["profile"])
        run_id = context["run_id"] if "run_id" in context else context["dag_run"].run_id
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
        if progress.done or now > batch.expires_at:
            why = "every shard is done" if progress.done else "the completion window is over"
            log.info("autoscale ends: %s (%d/%d answered)", why, progress.answered, progress.total)
            return {"ended": why, "answered": progress.answered, "total": progress.total}

        work = progress.remaining(profile)
        roles_state = state.get("roles") or {}
        history = state.get("decisions") or {}
        scaler = RoleScaler(sync_api_client(settings.kubernetes_conn_id))
        decisions: dict[str, ScaleDecision] = {}
        try:
            for role, rs in settings.roles.items():
                current = scaler.replicas(rs.target)
                # vLLM's load gauges are not scraped yet: zeros (unsaturated) make the policy
                # use its learnt/nominal capacity and never hold for load.
                obs = RoleObservation(current.spec, current.ready, rates[rs.policy.work])
                decisions[role] = decide(rs.policy, work, obs, now, batch.expires_at,
                                         RoleState.from_dict(roles_state.get(role)))
            _apply(scaler, settings, decisions, batch.batch_id)
        except ScalingError as exc:
            if exc.status in PERMANENT:
                raise AirflowException(f"autoscale: {exc}") from exc
            log.warning("autoscale: %s; trying again in %ss", exc, self._interval(settings))
        for role, d in decisions.items():
            roles_state[role] = d.state.as_dict()
            history[role] = ([*history.get(role, []), d.as_dict()])[-KEEP_DECISIONS:]
        state["roles"], state["decisions"] = roles_state, history
        context["ti"].xcom_push(key=DECISIONS_KEY, value=history)
        if settings.pushgateway:
            from prometheus_client import push_to_gateway

            push_to_gateway(settings.pushgateway, job="aibrix_batch_autoscale", registry=metrics.REGISTRY)
        from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger

        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=self._interval(settings))),
                   method_name="tick", kwargs={"state": state})
        raise AssertionError("defer() raises")  # pragma: no cover

    def _interval(self, settings: ScalingSettings) -> float:
        return self.interval_s if self.interval_s is not None else settings.interval_s


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
