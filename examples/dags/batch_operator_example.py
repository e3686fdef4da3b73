"""A user's DAG with batch inference as one step: ``AIBrixBatchOperator`` sends a JSONL file
through an OpenAI-compatible Batch API (this project's, or any other the ``aibrix_batch``
connection names), defers while it runs, and hands the batch's result to the next task; its
Asset gets an event carrying the batch (ids, counts, usage), and ``batch_operator_example_scores``,
scheduled on that Asset, runs on every such event and reads the batch from it.

Copy it into your DAGs folder and create the connection, e.g.::

    airflow connections add aibrix_batch_default --conn-type aibrix_batch \\
        --conn-host http://airflow-api-server:8080 --conn-password "$BATCH_API_KEY"

then trigger it with ``{"input_file": "/data/eval.jsonl", "model": "tiny-llama"}``.
"""

from __future__ import annotations

import json
from datetime import timedelta

from airflow.sdk import DAG, Asset, Param, task

from aibrix_operators.operators.batch_api import AIBrixBatchOperator

ANSWERS = Asset(name="aibrix_batch_example_answers", uri="aibrix-batch://examples/answers")

with DAG(
    "batch_operator_example",
    schedule=None,
    catchup=False,
    params={
        "input_file": Param(type="string", description="a JSONL batch file the workers can read"),
        "model": Param(type="string", description="the model every line names"),
        "report": Param("", type="string", description="where the score task writes its summary"),
        "stop_rules": Param({}, type="object", description='e.g. {"max_error_rate": 0.2}: stop the batch '
                                                            "early (docs/stop-rules.md)"),
    },
    render_template_as_native_obj=True,  # stop_rules reaches the operator as an object
    tags=["aibrix", "example"],
) as dag:
    answer = AIBrixBatchOperator(
        task_id="answer",
        input_file="{{ params.input_file }}",
        model="{{ params.model }}",
        completion_window="24h",
        metadata={"team": "examples"},
        stop_rules="{{ params.stop_rules }}",
        outlets=[ANSWERS],
        # A lost worker or an API that did not answer: the next try re-attaches to the batch.
        retries=2,
        retry_delay=timedelta(seconds=0),
        poll_interval_s=0.5,
    )

    @task
    def score(result: dict, params: dict | None = None) -> dict:
        """A stand-in for scoring: what share of the batch answered."""
        counts = result["request_counts"]
        summary = {"batch_id": result["batch_id"], "answered": counts["completed"] / max(counts["total"], 1),
                   "output_uri": result["output_uri"]}
        if params and params.get("report"):
            with open(params["report"], "w") as fh:
                json.dump({"result": result, "summary": summary}, fh)
        return summary

    score(answer.output)


with DAG("batch_operator_example_scores", schedule=[ANSWERS], catchup=False, tags=["aibrix", "example"]):

    @task
    def score_event(triggering_asset_events: dict | None = None) -> list[dict]:
        """Runs on the upstream DAG's batches (one event each): each event's extra is a batch."""
        assert triggering_asset_events is not None
        scores = []
        for event in triggering_asset_events[ANSWERS]:
            counts = event.extra["request_counts"]
            scores.append({"batch_id": event.extra["batch_id"],
                           "answered": counts["completed"] / max(counts["total"], 1)})
        return scores

    score_event()
