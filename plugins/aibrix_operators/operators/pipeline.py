"""The batch pipeline: its params and its tasks, for every DAG that runs a batch.

``batch_inference`` and the nightly evals' batch group both call ``add_batch_tasks``, so they
cannot drift apart (they did: the eval's copy hard-coded limits and dropped prefix grouping).

    validate → split → roles_ready → dispatch × shards → merge
    record_failure (one_failed) · autoscale beside dispatch · scale_down (all_done)

``BATCH_PARAMS`` are the trigger form's fields (the DAG adds ``input_uri`` and ``output_uri``
with its own defaults); ``add_batch_tasks`` takes one value per param, a template
(``"{{ params.concurrency }}"``) or a plain value, and nothing is hard-coded in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from airflow.sdk import Param

from aibrix_operators.batch.job_pool import KEYS as POOL_KEYS
from aibrix_operators.batch.lifecycle import Step
from aibrix_operators.batch.records import (
    DEFAULT_COMPLETION_WINDOW,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_REQUESTS,
    SUPPORTED_ENDPOINTS,
)
from aibrix_operators.driver.config import DEFAULT_ENDPOINT_WAIT_S, default
from aibrix_operators.notifications.webhook import BatchWebhookNotifier
from aibrix_operators.operators.batch import (
    MergeBatchOperator,
    RecordBatchFailureOperator,
    SplitBatchOperator,
    ValidateBatchOperator,
)
from aibrix_operators.operators.dispatch import DispatchShardOperator
from aibrix_operators.scheduling.recovery import dispatch_retry_policy
from aibrix_operators.sensors import AutoscaleSensor, RolesReadySensor, ScaleDownOperator
from aibrix_operators.settings.driver_pods import dispatch_pool
from aibrix_operators.settings.role_scaling import roles_configured

# Params whose empty value means "the default" carry "null" in their type: Airflow's trigger
# form marks every other string field required and will not submit it empty.
BATCH_PARAMS: dict[str, Param] = {
    "endpoint": Param(
        "", type=["null", "string"], pattern=r"^(https?://\S+)?$",
        description="Base URL of the OpenAI-compatible server (vLLM or the P/D router); must be on "
        "the deployment's allow-list and gets no API key. Empty: the inference connection's host, "
        "else http://127.0.0.1:8000.",
    ),
    "inference_conn_id": Param(
        None, type=["null", "string"],
        description="Airflow HTTP connection of the inference server (host, and the API key as its "
        "password); the key is sent only to that connection's host.",
    ),
    "batch_endpoint": Param(
        "auto", type="string", enum=["auto", *SUPPORTED_ENDPOINTS],
        values_display={"auto": "auto: the first line's url"},
        description="The batch's API endpoint; every line's url must match it.",
    ),
    "model": Param(
        None, type=["null", "string"],
        description="Expected body.model of every line; empty accepts the file's own model.",
    ),
    "requests_per_shard": Param(5000, type="integer", minimum=1, description="Requests per shard."),
    "bytes_per_shard": Param(
        64 * 1024 * 1024, type="integer", minimum=1024, description="Bytes per shard at most."
    ),
    "prefix_grouping": Param(
        "auto", type="string", enum=["auto", "off"],
        description="auto: requests sharing a prompt prefix (few-shot template, system prompt) go to "
        "the same shard, back to back, so the server's prefix cache reuses it; skipped when the file "
        "shows no shared prefixes. Output stays in input order. off: shards keep input order.",
    ),
    "concurrency": Param(default("concurrency"), type="integer", minimum=1, maximum=4096,
                         description="Requests in flight per shard."),
    # The job pool (batch/job_pool.py, docs/job-pool.md): AIBrix's pool keys, bounded by the
    # deployment's [aibrix_batch] pool_* limits.
    "max_workers": Param(
        None, type=["null", "integer"], minimum=1,
        description="Shards of this batch dispatched at once; the others wait without a worker slot. "
        "Empty: as many as the dispatch pool allows. At most [aibrix_batch] pool_max_workers.",
    ),
    "memory_per_job": Param(
        None, type=["null", "string"], maxLength=32,
        description="kubernetes mode: each driver pod's memory request and limit (e.g. 2Gi). Empty: the "
        "deployment's driver_memory_*. At most [aibrix_batch] pool_max_memory_per_job.",
    ),
    "gpu_policy": Param(
        None, type=["null", "string"], enum=[None, "", "pack", "spread"],
        description="How the serving group's pods are placed: pack (fill a node) or spread (across "
        "nodes). The deployment's choice ([aibrix_batch] gpu_policy); only a restatement of it.",
    ),
    "max_attempts": Param(default("max_attempts"), type="integer", minimum=1, maximum=20,
                          description="Attempts per request on 429/5xx/timeouts."),
    "endpoint_wait_s": Param(
        DEFAULT_ENDPOINT_WAIT_S, type="number", minimum=0,
        description="How long a shard waits for a starting or restarting endpoint before failing.",
    ),
    "outage_budget_s": Param(
        default("outage_budget_s"), type="number", minimum=1,
        description="How long a running shard waits out an endpoint that answers nothing (restart, "
        "502/503 storm) before the task fails and Airflow retries it; requests are never failed for it.",
    ),
    "request_timeout_s": Param(default("request_timeout_s"), type="number", minimum=1,
                               description="Per-request timeout."),
    "cache_salt": Param(
        None, type=["null", "string"], maxLength=128,
        description="vLLM cache_salt added to every chat/completions request, as param:<salt> (a "
        "line's own is kept under it): requests share cached prompt prefixes only with the same "
        "salt. Batch API runs get their tenant's salt instead; empty: the lines' own.",
    ),
    "capacity_mode": Param(
        None, type=["null", "string"], enum=[None, "", "shared", "dedicated"],
        description="Empty: the deployment's mode for the endpoint. shared: the endpoint also serves "
        "online traffic, so batch requests yield to it (priority, adaptive concurrency); dedicated: the "
        "batch may use all of it. Only a restatement of the deployment's [aibrix_batch] shared_endpoints; "
        "anything else is refused (docs/shared-capacity.md).",
    ),
    "completion_window": Param(
        DEFAULT_COMPLETION_WINDOW, type="string", pattern="^[0-9]+[hms]$",
        description="Deadline from submission; requests not started by then end as batch_expired.",
    ),
    "execution_mode": Param(
        "local", type="string", enum=["local", "kubernetes"],
        description="Where shard drivers run: in the Airflow worker, or in driver pods (deferrable "
        "the provider's KubernetesPodTrigger; cluster, image and Secrets are the deployment's: "
        "docs/dispatch.md).",
    ),
    "kubernetes_namespace": Param(
        "", type=["null", "string"],
        description="kubernetes mode: namespace of the driver pods. Empty: the deployment's; any other "
        "must be in [aibrix_batch] allowed_kubernetes_namespaces.",
    ),
    "kubernetes_service_account": Param(
        "", type=["null", "string"],
        description="kubernetes mode: service account of the driver pods. Empty: the deployment's; any "
        "other must be in [aibrix_batch] allowed_kubernetes_service_accounts.",
    ),
    "max_requests": Param(DEFAULT_MAX_REQUESTS, type="integer", minimum=1),
    "max_file_bytes": Param(DEFAULT_MAX_FILE_BYTES, type="integer", minimum=1),
    "max_line_bytes": Param(DEFAULT_MAX_LINE_BYTES, type="integer", minimum=1),
    "aws_conn_id": Param(
        None, type=["null", "string"],
        description="Airflow connection for s3:// URIs; empty uses boto3's default credentials.",
    ),
    "metadata": Param({}, type="object", description="Free-form string pairs kept in batch.json."),
    "stop_rules": Param(
        {}, type="object",
        description="Stop the batch early (docs/stop-rules.md): {\"max_error_rate\": 0.2} stops it once more "
                    "than 20 % of at least error_rate_min_sample (default 100) answers are the requests' "
                    "own errors; {\"max_total_tokens\": N} once it used N tokens. Empty: no rule.",
    ),
    "output_expires_after": Param(
        None, type=["null", "object"],
        description="OpenAI's {\"anchor\": \"created_at\", \"seconds\": N} (3600 to 2592000): the output "
                    "and error files are deleted N seconds after they are written. Empty: kept.",
    ),
    "dry_run": Param(
        False, type="boolean",
        description="Validate and estimate only (docs/admission.md#dry-run): the estimate (requests, "
                    "tokens, duration at the measured rate, cost) goes to <output_uri>/estimate.json and "
                    "every later step is skipped: nothing is split or sent.",
    ),
}


def param_defaults() -> dict[str, Any]:
    """Every batch param at its default (what a batch group gets unless told otherwise)."""
    return {name: param.value for name, param in BATCH_PARAMS.items()}


def from_params() -> dict[str, str]:
    """Every batch param as a template of the DAG's own param of that name."""
    return {name: "{{ params." + name + " }}" for name in BATCH_PARAMS}


class BatchTasks(NamedTuple):
    validate: Any
    split: Any
    dispatch: Any
    merge: Any
    record_failure: Any
    # None where the deployment scales no serving roles ([aibrix_scaling] roles unset).
    roles_ready: Any
    autoscale: Any
    scale_down: Any


def add_batch_tasks(
    args: Mapping[str, Any], *, input_uri: Any, output_uri: Any, group_id: str | None = None,
    outlets: Sequence[Any] = (),
) -> BatchTasks:
    """Add the pipeline's tasks to the DAG or TaskGroup being defined.

    ``args`` holds a value for every name in ``BATCH_PARAMS`` (a missing or extra one is an
    error: that is how the two callers stayed in step). ``group_id`` is the enclosing
    TaskGroup's, so record_failure can find its steps' task ids. ``outlets``: the Assets whose
    event merge emits when the batch ends, its extra the batch (``asset_extra``). The batch's
    end is also told to the deployment's webhook, if it sets one (notifications/webhook.py).
    """
    missing, extra = set(BATCH_PARAMS) - set(args), set(args) - set(BATCH_PARAMS)
    if missing or extra:
        raise ValueError(f"batch pipeline args: missing {sorted(missing)}, unknown {sorted(extra)}")
    a = args
    prefix = f"{group_id}." if group_id else ""
    validate = ValidateBatchOperator(
        task_id=Step.VALIDATE.value, input_uri=input_uri, output_uri=output_uri,
        batch_endpoint=a["batch_endpoint"], expected_model=a["model"], max_requests=a["max_requests"],
        max_file_bytes=a["max_file_bytes"], max_line_bytes=a["max_line_bytes"],
        completion_window=a["completion_window"], metadata=a["metadata"], aws_conn_id=a["aws_conn_id"],
        endpoint=a["endpoint"], inference_conn_id=a["inference_conn_id"],
        prefix_grouping=a["prefix_grouping"], job_pool={k: a[k] for k in POOL_KEYS},
        stop_rules=a["stop_rules"], output_expires_after=a["output_expires_after"], dry_run=a["dry_run"],
    )  # fmt: skip
    split = SplitBatchOperator(
        task_id=Step.SPLIT.value, validated=validate.output, requests_per_shard=a["requests_per_shard"],
        bytes_per_shard=a["bytes_per_shard"], aws_conn_id=a["aws_conn_id"],
    )  # fmt: skip
    dispatch = DispatchShardOperator.partial(
        task_id=Step.DISPATCH.value, validated=validate.output, endpoint=a["endpoint"],
        inference_conn_id=a["inference_conn_id"], concurrency=a["concurrency"],
        max_attempts=a["max_attempts"], request_timeout_s=a["request_timeout_s"],
        cache_salt=a["cache_salt"], capacity_mode=a["capacity_mode"], endpoint_wait_s=a["endpoint_wait_s"],
        outage_budget_s=a["outage_budget_s"], execution_mode=a["execution_mode"],
        kubernetes_namespace=a["kubernetes_namespace"],
        kubernetes_service_account=a["kubernetes_service_account"], aws_conn_id=a["aws_conn_id"],
        max_workers=a["max_workers"], memory_per_job=a["memory_per_job"],
        # Bounds concurrent dispatch tasks, and so driver pods (create it with --include-deferred:
        # a deferred task waiting on its pod must keep its slot). default_pool unless configured.
        pool=dispatch_pool(),
        # Retries resume from checkpoints; sized for node losses (scheduling/recovery.py).
        **dispatch_retry_policy(),
    ).expand(shard=split.output)  # fmt: skip
    notify = BatchWebhookNotifier(validate_task_id=f"{prefix}{Step.VALIDATE}")
    merge = MergeBatchOperator(task_id=Step.MERGE.value, validated=validate.output, shards=split.output,
                               outcomes=dispatch.output, aws_conn_id=a["aws_conn_id"], outlets=list(outlets),
                               on_success_callback=notify)  # fmt: skip
    record_failure = RecordBatchFailureOperator(
        task_id=Step.RECORD_FAILURE.value, aws_conn_id=a["aws_conn_id"], output_uri=output_uri,
        input_uri=input_uri, trigger_rule="one_failed", validate_task_id=f"{prefix}{Step.VALIDATE}",
        step_task_ids=tuple(f"{prefix}{t}" for t in (Step.SPLIT, Step.DISPATCH, Step.MERGE)),
        on_failure_callback=notify,
    )  # fmt: skip
    [validate, split, dispatch, merge] >> record_failure
    # Serving roles: only where the deployment names some ([aibrix_scaling] roles, read as the DAG
    # is parsed); they act only with execution_mode=kubernetes (otherwise roles_ready succeeds at
    # once and autoscale / scale_down skip, sensors/scaling.py).
    if not roles_configured():
        return BatchTasks(validate, split, dispatch, merge, record_failure, None, None, None)
    roles_ready = RolesReadySensor(task_id=Step.ROLES_READY.value, validated=validate.output,
                                   execution_mode=a["execution_mode"], aws_conn_id=a["aws_conn_id"])
    autoscale = AutoscaleSensor(task_id=Step.AUTOSCALE.value, validated=validate.output, shards=split.output,
                                execution_mode=a["execution_mode"], aws_conn_id=a["aws_conn_id"])
    scale_down = ScaleDownOperator(task_id=Step.SCALE_DOWN.value, execution_mode=a["execution_mode"])
    split >> roles_ready >> [dispatch, autoscale]
    [merge, autoscale] >> scale_down
    return BatchTasks(validate, split, dispatch, merge, record_failure, roles_ready, autoscale,
                      scale_down)  # fmt: skip
