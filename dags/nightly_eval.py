"""nightly_eval__<suite>: one DAG per suite in config/eval_suites.yaml.

render the dataset → the batch pipeline (a TaskGroup of the same operators as batch_inference)
→ evaluate (score, CI, compare with the previous night and the baseline) → report (HTML +
Markdown, dropped off under eval/<suite>/<date>/) → regression_gate (fails on a regression).

One DAG per suite, not one parameterised DAG: each suite keeps its own cron schedule, its own
run history, and a regression in one suite is a red run of that suite's DAG alone. A suite with
``on_assets`` also runs when any of those Assets gets an event (a new checkpoint published by a
training DAG, say), as well as on its cron.
Wiring only; the logic lives in ``aibrix_operators.evaluation``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Asset, AssetAny, AssetOrTimeSchedule, CronTriggerTimetable, Param, task

from aibrix_operators.evaluation.suites import Suite, load_suites
from aibrix_operators.operators.batch_group import batch_inference_group
from aibrix_operators.operators.eval_tasks import evaluate_night, plan_night, regression_gate, report_night


def params_for(suite: Suite) -> dict[str, Param]:
    return {
        "night": Param("", type="string", pattern=r"^(\d{4}-\d{2}-\d{2})?$",
                       description="The night (YYYY-MM-DD) to record; empty: the run's logical date."),
        "model": Param(suite.models[0], type="string", enum=list(suite.models),
                       description="Served model name to evaluate (one of the suite's models)."),
        "endpoint": Param("", type="string", pattern=r"^(https?://\S+)?$",
                          description="OpenAI-compatible server; allow-listed like batch_inference's."),
        "inference_conn_id": Param(None, type=["null", "string"],
                                   description="Airflow HTTP connection of the inference server."),
        "report_uri": Param("", type="string",
                            description="Root for eval/<suite>/<date>/ (local dir or s3://bucket/prefix); "
                            "empty: .work. Must be allow-listed."),
        "aws_conn_id": Param(None, type=["null", "string"], description="Connection for s3:// URIs."),
        "concurrency": Param(32, type="integer", minimum=1, maximum=4096),
    }


def schedule_for(suite: Suite) -> str | AssetOrTimeSchedule:
    """The suite's cron; with ``on_assets``, that cron or an event on any of the Assets."""
    if not suite.on_assets:
        return suite.schedule
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(suite.schedule, timezone="UTC"),
                               assets=AssetAny(*(Asset(uri=uri, name=uri) for uri in suite.on_assets)))


def build(suite: Suite) -> DAG:
    with DAG(
        dag_id=f"nightly_eval__{suite.name}",
        description=suite.description or f"nightly eval of suite {suite.name}",
        schedule=schedule_for(suite), start_date=datetime(2026, 1, 1), catchup=False,
        params=params_for(suite), render_template_as_native_obj=True, max_active_runs=1,
        tags=["aibrix", "eval"], doc_md=__doc__,
    ) as dag:
        plan = task(plan_night, task_id="render", multiple_outputs=True)(suite.name)
        batch = batch_inference_group(
            "batch", input_uri=plan["input_uri"], output_uri=plan["output_uri"],
            endpoint="{{ params.endpoint }}", model="{{ params.model }}",
            inference_conn_id="{{ params.inference_conn_id }}", aws_conn_id="{{ params.aws_conn_id }}",
            concurrency="{{ params.concurrency }}",
        )
        summary = task(evaluate_night, task_id="evaluate")(suite.name, plan["plan"])
        reported = task(report_night, task_id="report")(suite.name, plan["plan"])
        gate = task(regression_gate, task_id="regression_gate")(summary)
        plan >> batch.group
        batch.merge >> summary >> reported >> gate
    return dag


def _all() -> dict[str, Any]:
    return {f"nightly_eval__{name}": build(suite) for name, suite in load_suites().items()}


globals().update(_all())
