"""The nightly eval's task callables: thin adapters from Airflow context to ``evaluation.steps``."""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import get_current_context
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.evaluation import steps
from aibrix_operators.evaluation.suites import load_suites
from aibrix_operators.hooks.batch_storage import BatchStorageHook
from aibrix_operators.settings.locations import eval_report_root
from aibrix_operators.trust.deployment import load_policy
from aibrix_operators.trust.policy import TrustViolation

log = logging.getLogger(__name__)


def _plan(suite_name: str, plan: dict[str, Any] | None = None) -> tuple[Any, steps.NightPlan, Any]:
    suite = load_suites()[suite_name]
    ctx = get_current_context()
    params = ctx["params"]
    if plan is None:
        when = ctx.get("logical_date") or ctx["dag_run"].run_after
        night = params.get("night") or when.date().isoformat()
        plan = {"suite": suite_name, "date": night, "model": params.get("model") or suite.models[0],
                "root": params.get("report_uri") or eval_report_root()}
    night_plan = steps.NightPlan(plan["suite"], plan["date"], plan["model"], plan["root"])
    storage = BatchStorageHook(params.get("aws_conn_id")).storage_for(night_plan.root)
    return suite, night_plan, storage


def plan_night(suite_name: str) -> dict[str, Any]:
    """Render the dataset into the night's batch file; the trigger's report root is allow-listed
    like any output (the batch's own validate checks the batch prefix again)."""
    suite, plan, storage = _plan(suite_name)
    params = get_current_context()["params"]
    try:
        policy = load_policy()
        policy.check_storage(plan.root, "report_uri")
        policy.check_aws_conn(params.get("aws_conn_id"))
    except TrustViolation as exc:
        raise AirflowFailException(f"refused_by_policy: {exc}") from exc
    rendered = steps.render(suite, plan, storage)
    log.info("suite %s night %s model %s: %d items → %s", suite.name, plan.date, plan.model,
             rendered["items"], plan.batch_input)
    return {"input_uri": plan.batch_input, "output_uri": plan.batch_output, "plan": plan.as_dict()}


def evaluate_night(suite_name: str, plan: dict[str, Any]) -> dict[str, Any]:
    suite, night, storage = _plan(suite_name, plan)
    summary = steps.evaluate(suite, night, storage, run_id=get_current_context()["run_id"])
    iv = summary["interval"]
    log.info("suite %s: score %.4f [%.4f, %.4f] over %d items", suite.name, iv["mean"], iv["low"],
             iv["high"], iv["n"])
    for model, judged in (summary.get("models") or {summary["model"]: summary}).items():
        iv = judged["interval"]
        log.info("%s: score %.4f [%.4f, %.4f]", model, iv["mean"], iv["low"], iv["high"])
        for c in judged["comparisons"]:
            log.info("%s vs %s (%s): %+.4f — %s", model, c["against"], c["reference_date"], c["delta"],
                     c["reason"])
    return summary


def report_night(suite_name: str, plan: dict[str, Any]) -> dict[str, Any]:
    suite, night, storage = _plan(suite_name, plan)
    written = steps.report(suite, night, storage)
    log.info("report written: %s", written["report"])
    return written


def regression_gate(summary: dict[str, Any]) -> None:
    """Red in the UI when the night regressed; runs after the report, so the report exists. With
    adapters evaluated beside the model, the message names each model that regressed, alone."""
    per_model = summary.get("models") or {summary["model"]: summary}
    bad = {model: [c["reason"] for c in judged["comparisons"] if c["regression"]]
           for model, judged in per_model.items()}
    bad = {model: reasons for model, reasons in bad.items() if reasons}
    if bad:
        said = "; ".join(f"{model}: {', '.join(reasons)}" for model, reasons in bad.items())
        raise AirflowFailException(f"eval regression in suite {summary['suite']} ({summary['date']}) "
                                   f"of {', '.join(bad)}: {said}")
    log.info("no regression in suite %s (%s)", summary["suite"], ", ".join(per_model))
