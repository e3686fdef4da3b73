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

from airflow.sdk import BaseOperator, BaseSensorOperator, Context, PokeReturnValue
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


class RolesReadySensor(UsesBatchStorage, BaseSensorOperator):
    """Bring the serving roles up to the batch's first decision, then wait until each has a ready
    pod group.

    A sensor in Airflow's sense: ``poke`` is the readiness check, ``poll_interval_s`` and
    ``timeout_s`` are its ``poke_interval`` and ``timeout``. Deferrable by default (the
    ``RolesReadyTrigger`` polls, no worker slot is held); ``deferrable=False`` pokes in the worker.

    :param validated: The validate task's output. (templated)
    :param execution_mode: Acts only for ``kubernetes``. (templated)
    :param aws_conn_id: Airflow connection for ``s3://`` inputs (to sample the requests). (templated)
    :param poll_interval_s: Seconds between readiness checks.
    :param timeout_s: Seconds the roles get to become ready.
    :param deferrable: Wait in the triggerer (default) or in the worker.
    """

    template_fields: Sequence[str] = ("validated", "execution_mode", "aws_conn_id")

    def __init__(self, *, validated: Any, execution_mode: str = "local", aws_conn_id: str | None = None,
                 poll_interval_s: float = 10.0, timeout_s: float = 1800.0, deferrable: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(poke_interval=poll_interval_s, timeout=timeout_s, **kwargs)
        self.validated = validated
        self.execution_mode = execution_mode
        self.aws_conn_id = aws_conn_id
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.deferrable = deferrable

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
        if not self.deferrable:
            return super().execute(context)  # pokes until ready or timeout_s
        self.defer(
            trigger=RolesReadyTrigger(
                targets=[rs.target.__dict__ for rs in settings.roles.values()], want=_want(settings),
                kubernetes_conn_id=settings.kubernetes_conn_id, poll_interval_s=self.poll_interval_s,
                timeout_s=self.timeout_s),
            method_name="execute_complete",
        )
        raise AssertionError("defer() raises")  # pragma: no cover

    def poke(self, context: Context) -> PokeReturnValue:
        """Every role has ``gang_size`` ready replicas (at least one whole pod group)."""
        settings = _active_settings(self.execution_mode)
        if settings is None:
            return PokeReturnValue(True, {"scaled": False})
        scaler = RoleScaler(sync_api_client(settings.kubernetes_conn_id))
        ready = {role: scaler.replicas(rs.target).ready for role, rs in settings.roles.items()}
        done = all(ready[role] >= n for role, n in _want(settings).items())
        log.info("serving roles ready: %s (wanted %s)", ready, _want(settings))
        return PokeReturnValue(done, {"scaled": True, "ready": ready} if done else None)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "ready":
            raise AirflowException(f"serving roles not ready: {event.get('message')}")
        log.info("serving roles ready: %s", event["ready"])
        return {"scaled": True, "ready": event["ready"]}


def _want(settings: ScalingSettings) -> dict[str, int]:
    return {role: max(rs.policy.gang_size, 1) for role, rs in settings.roles.items()}


class AutoscaleSensor(UsesBatchStorage, BaseSensorOperator):
    """Scale the serving roles while the batch's shards run; done when the batch is.

    A sensor in Airflow's sense: each ``poke`` is one tick (scrape, decide, apply) and the
    condition it waits for is the batch's end (every shard answered, every dispatch task
    finished, or the window over). Deferrable by default: between ticks it waits in the
    triggerer, carrying its state in the deferral; ``deferrable=False`` pokes in the worker.

    :param validated: The validate task's output. (templated)
    :param shards: The split task's output. (templated)
    :param execution_mode: Acts only for ``kubernetes``. (templated)
    :param aws_conn_id: Airflow connection for ``s3://`` URIs. (templated)
    :param interval_s: Seconds between ticks (at least ``MIN_INTERVAL_S``); default: the
        deployment's ``[aibrix_scaling] interval_s``.
    :param dispatch_task_id: The dispatch task, whose instances' ends also end the autoscaler.
    :param deferrable: Wait between ticks in the triggerer (default) or in the worker.
    """

    template_fields: Sequence[str] = ("validated", "shards", "execution_mode", "aws_conn_id")

    def __init__(self, *, validated: Any, shards: Any, execution_mode: str = "local",
                 aws_conn_id: str | None = None, interval_s: float | None = None,
                 dispatch_task_id: str | None = "dispatch", deferrable: bool = True, **kwargs: Any) -> None:
        super().__init__(poke_interval=max(interval_s or MIN_INTERVAL_S, MIN_INTERVAL_S), **kwargs)
        self.validated = validated
        self.shards = shards
        self.execution_mode = execution_mode
        self.aws_conn_id = aws_conn_id
        self.interval_s = interval_s
        self.dispatch_task_id = dispatch_task_id
        self.deferrable = deferrable
        self._poke_state: dict[str, Any] = {}

    def execute(self, context: Context) -> dict[str, Any]:
        settings = _active_settings(self.execution_mode)
        if settings is None:
            raise AirflowSkipException(f"execution_mode={self.execution_mode} or no [aibrix_scaling] roles")
        if not self.deferrable:
            self.poke_interval = self._interval(settings)
            return super().execute(context)  # pokes (one tick each) until the batch ends
        # The first decision is made here, with a scrape of its own: deferring for it at once
        # would resume the task before the executor has reported this run's end, which the
        # scheduler takes for a task killed externally (see MIN_INTERVAL_S).
        load = asyncio.run(scrape_load(_sources(settings), settings.kubernetes_conn_id))
        return self.tick(context, event={"status": "tick", "load": load}, state={})

    def poke(self, context: Context) -> PokeReturnValue:
        """One tick: scrape each role's load, decide, apply; done once the batch has ended."""
        settings = _active_settings(self.execution_mode)
        if settings is None:
            raise AirflowSkipException(f"execution_mode={self.execution_mode} or no [aibrix_scaling] roles")
        load = asyncio.run(scrape_load(_sources(settings), settings.kubernetes_conn_id))
        ended, self._poke_state = self._step(context, {"status": "tick", "load": load}, self._poke_state)
        return PokeReturnValue(ended is not None, ended)

    def tick(
        self, context: Context, event: Any = None, state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Resume after ``AutoscaleTickTrigger``: one tick, then defer again until the batch ends."""
        ended, state = self._step(context, event, state)
        if ended is not None:
            return ended
        settings = _active_settings(self.execution_mode)
        assert settings is not None  # _step skipped otherwise
        self._defer(settings, state, delay_s=self._interval(settings))
        raise AssertionError("defer() raises")  # pragma: no cover

    def _step(
        self, context: Context, event: Any, state: dict[str, Any] | None
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """One tick; ``(the task's result, state)`` once the batch has ended, else ``(None, state)``."""
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
            return {"ended": why, "answered": progress.answered, "total": progress.total}, state

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
        return None, state

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
