"""batch_inference: an OpenAI Batch JSONL file in, OpenAI batch output out.

validate → split → dispatch (one mapped task per shard) → merge;
record_failure publishes a failed batch.json if a step after validation fails.
Wiring and parameters only; the logic lives in ``aibrix_operators``.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, Param

from aibrix_operators.airflow_recovery import dispatch_retry_policy
from aibrix_operators.batch.records import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_REQUESTS,
    SUPPORTED_ENDPOINTS,
)
from aibrix_operators.hooks.driver_pods import dispatch_pool
from aibrix_operators.localenv import default_output_uri
from aibrix_operators.operators import (
    DispatchShardOperator,
    MergeBatchOperator,
    RecordBatchFailureOperator,
    SplitBatchOperator,
    ValidateBatchOperator,
)
from aibrix_operators.sensors import AutoscaleSensor, RolesReadySensor, ScaleDownOperator

REPO_ROOT = Path(__file__).resolve().parents[1]

# The trigger's output_uri, or a directory of the run's own (never a shared "latest").
OUTPUT_URI = "{{ params.output_uri or default_output_uri(run_id) }}"

PARAMS = {
    "input_uri": Param(
        str(REPO_ROOT / "examples" / "chat_batch.jsonl"), type="string", minLength=1,
        description="The OpenAI Batch JSONL file: a local path or s3://bucket/key.",
    ),
    # Params whose empty value means "the default" carry "null" in their type: Airflow's trigger
    # form marks every other string field required and will not submit it empty.
    "output_uri": Param(
        "", type=["null", "string"],
        description="Where output.jsonl, errors.jsonl and batch.json go: a local directory or "
        "s3://bucket/prefix. Empty: a directory of this run's own, .work/outputs/<run id>.",
    ),
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
    "concurrency": Param(64, type="integer", minimum=1, maximum=4096,
                         description="Requests in flight per shard."),
    "max_attempts": Param(5, type="integer", minimum=1, maximum=20,
                          description="Attempts per request on 429/5xx/timeouts."),
    "endpoint_wait_s": Param(
        300, type="number", minimum=0,
        description="How long a shard waits for a starting or restarting endpoint before failing.",
    ),
    "outage_budget_s": Param(
        900, type="number", minimum=1,
        description="How long a running shard waits out an endpoint that answers nothing (restart, "
        "502/503 storm) before the task fails and Airflow retries it; requests are never failed for it.",
    ),
    "request_timeout_s": Param(600, type="number", minimum=1, description="Per-request timeout."),
    "cache_salt": Param(
        None, type=["null", "string"], maxLength=128,
        description="vLLM cache_salt added to every chat/completions request (a line's own is kept "
        "under it): requests share cached prompt prefixes only with the same salt. The Batch API "
        "sets an unguessable one per tenant; empty: the lines' own.",
    ),
    "completion_window": Param(
        "24h", type="string", pattern="^[0-9]+[hms]$",
        description="Deadline from submission; requests not started by then end as batch_expired.",
    ),
    "execution_mode": Param(
        "local", type="string", enum=["local", "kubernetes"],
        description="Where shard drivers run: in the Airflow worker, or in driver pods (deferrable "
        "KubernetesPodOperator; cluster, image and Secrets are the deployment's: docs/dispatch.md).",
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
}

with DAG(
    dag_id="batch_inference",
    description="OpenAI Batch JSONL → vLLM → OpenAI batch output",
    schedule=None,
    catchup=False,
    params=PARAMS,
    render_template_as_native_obj=True,
    max_active_tasks=16,
    tags=["aibrix", "batch", "llm"],
    user_defined_macros={"default_output_uri": default_output_uri},
    doc_md=__doc__,
) as dag:
    validate = ValidateBatchOperator(
        task_id="validate",
        input_uri="{{ params.input_uri }}",
        output_uri=OUTPUT_URI,
        batch_endpoint="{{ params.batch_endpoint }}",
        expected_model="{{ params.model }}",
        max_requests="{{ params.max_requests }}",
        max_file_bytes="{{ params.max_file_bytes }}",
        max_line_bytes="{{ params.max_line_bytes }}",
        completion_window="{{ params.completion_window }}",
        metadata="{{ params.metadata }}",
        aws_conn_id="{{ params.aws_conn_id }}",
        endpoint="{{ params.endpoint }}",
        inference_conn_id="{{ params.inference_conn_id }}",
        prefix_grouping="{{ params.prefix_grouping }}",
    )
    split = SplitBatchOperator(
        task_id="split",
        validated=validate.output,
        requests_per_shard="{{ params.requests_per_shard }}",
        bytes_per_shard="{{ params.bytes_per_shard }}",
        aws_conn_id="{{ params.aws_conn_id }}",
    )
    dispatch = DispatchShardOperator.partial(
        task_id="dispatch",
        validated=validate.output,
        endpoint="{{ params.endpoint }}",
        inference_conn_id="{{ params.inference_conn_id }}",
        concurrency="{{ params.concurrency }}",
        max_attempts="{{ params.max_attempts }}",
        request_timeout_s="{{ params.request_timeout_s }}",
        cache_salt="{{ params.cache_salt }}",
        endpoint_wait_s="{{ params.endpoint_wait_s }}",
        outage_budget_s="{{ params.outage_budget_s }}",
        execution_mode="{{ params.execution_mode }}",
        kubernetes_namespace="{{ params.kubernetes_namespace }}",
        kubernetes_service_account="{{ params.kubernetes_service_account }}",
        aws_conn_id="{{ params.aws_conn_id }}",
        # Bounds concurrent dispatch tasks, and so driver pods (create it with --include-deferred:
        # a deferred task waiting on its pod must keep its slot). default_pool unless configured.
        pool=dispatch_pool(),
        # Retries resume from checkpoints; sized for node losses (airflow_recovery.py).
        **dispatch_retry_policy(),
    ).expand(shard=split.output)
    merge = MergeBatchOperator(
        task_id="merge",
        validated=validate.output,
        shards=split.output,
        outcomes=dispatch.output,
        aws_conn_id="{{ params.aws_conn_id }}",
    )
    record_failure = RecordBatchFailureOperator(
        task_id="record_failure",
        aws_conn_id="{{ params.aws_conn_id }}",
        output_uri=OUTPUT_URI,
        input_uri="{{ params.input_uri }}",
        trigger_rule="one_failed",
    )
    [validate, split, dispatch, merge] >> record_failure
    # Serving roles: act only with execution_mode=kubernetes and [aibrix_scaling] roles set;
    # otherwise roles_ready succeeds at once and autoscale / scale_down skip (sensors/scaling.py).
    roles_ready = RolesReadySensor(task_id="roles_ready", validated=validate.output,
                                   execution_mode="{{ params.execution_mode }}",
                                   aws_conn_id="{{ params.aws_conn_id }}")
    autoscale = AutoscaleSensor(task_id="autoscale", validated=validate.output, shards=split.output,
                                execution_mode="{{ params.execution_mode }}",
                                aws_conn_id="{{ params.aws_conn_id }}")
    scale_down = ScaleDownOperator(task_id="scale_down", execution_mode="{{ params.execution_mode }}")
    split >> roles_ready >> [dispatch, autoscale]
    [merge, autoscale] >> scale_down
