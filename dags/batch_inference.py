"""batch_inference: an OpenAI Batch JSONL file in, OpenAI batch output out.

validate → split → dispatch (one mapped task per shard) → merge;
record_failure publishes a failed batch.json if a step after validation fails.
The params and tasks are the pipeline's (aibrix_operators/operators/pipeline.py, shared with the
nightly evals); this file adds where the batch's files are and the DAG itself.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, Asset, Param

from aibrix_operators.operators.pipeline import BATCH_PARAMS, add_batch_tasks, from_params
from aibrix_operators.settings.locations import default_output_uri

REPO_ROOT = Path(__file__).resolve().parents[1]

# Every batch's end is an event of this Asset, its extra the batch (id, status, counts, usage,
# model, output_uri): DAGs scheduled on it run on each batch (docs/operator.md#assets).
BATCH_OUTPUTS = Asset(name="aibrix_batch_inference_outputs", uri="aibrix-batch://batch_inference/outputs")

# The trigger's output_uri, or a directory of the run's own (never a shared "latest").
OUTPUT_URI = "{{ params.output_uri or default_output_uri(run_id) }}"

PARAMS = {
    "input_uri": Param(
        str(REPO_ROOT / "examples" / "chat_batch.jsonl"), type="string", minLength=1,
        description="The OpenAI Batch JSONL file: a local path or s3://bucket/key.",
    ),
    # Params whose empty value means "the default" carry "null" in their type (pipeline.py).
    "output_uri": Param(
        "", type=["null", "string"],
        description="Where output.jsonl, errors.jsonl and batch.json go: a local directory or "
        "s3://bucket/prefix. Empty: a directory of this run's own, .work/outputs/<run id>.",
    ),
    **BATCH_PARAMS,
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
    add_batch_tasks(from_params(), input_uri="{{ params.input_uri }}", output_uri=OUTPUT_URI,
                    outlets=[BATCH_OUTPUTS])
