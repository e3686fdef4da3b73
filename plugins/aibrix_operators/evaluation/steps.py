"""The nightly eval's steps as plain functions over storage (the DAG's tasks call these).

render   dataset → OpenAI Batch file under ``eval/<suite>/<date>/batch/input.jsonl``
(the batch pipeline runs it, writing ``batch/output.jsonl`` beside it)
evaluate answers → per-item ``results.jsonl`` and ``summary.json`` (score, CI, comparisons),
         history and baseline updated
report   ``report.html`` (self-contained) and ``report.md`` + ``trend.png``
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from aibrix_operators.batch.merging import BATCH_FILE
from aibrix_operators.evaluation import metrics as eval_metrics
from aibrix_operators.evaluation.history import (
    Night,
    load_baseline,
    load_history,
    night_prefix,
    previous_night,
    save_baseline,
    save_history,
)
from aibrix_operators.evaluation.report import (
    ModelRow,
    ReportData,
    regressed_items,
    render_html,
    render_markdown,
    trend_png,
)
from aibrix_operators.evaluation.scoring import headline, results_jsonl, score_items
from aibrix_operators.evaluation.stats import Comparison, Interval, compare
from aibrix_operators.evaluation.suites import Suite, night_models, read_dataset, render_batch, split_by_model
from aibrix_operators.storage import Storage, join_uri, storage_for


@dataclass(frozen=True)
class NightPlan:
    suite: str
    date: str
    model: str
    root: str

    @property
    def prefix(self) -> str:
        return night_prefix(self.root, self.suite, self.date)

    @property
    def batch_input(self) -> str:
        return join_uri(self.prefix, "batch", "input.jsonl")

    @property
    def batch_output(self) -> str:
        return join_uri(self.prefix, "batch")

    def as_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "date": self.date, "model": self.model, "root": self.root,
                "prefix": self.prefix, "input_uri": self.batch_input, "output_uri": self.batch_output}


def _dataset(suite: Suite, storage: Storage | None = None) -> list[dict[str, Any]]:
    uri = suite.dataset_path()
    store = storage if "://" in uri else storage_for(uri)
    return list(read_dataset(store.read_bytes(uri).decode().splitlines()))


def render(suite: Suite, plan: NightPlan, storage: Storage) -> dict[str, Any]:
    if plan.model not in suite.models:
        raise ValueError(f"model {plan.model!r} is not one of suite {suite.name}'s models {suite.models}")
    items = _dataset(suite, storage)
    storage.write_bytes(plan.batch_input, "".join(render_batch(suite, items, plan.model)).encode())
    return {**plan.as_dict(), "items": len(items)}


def _judge(suite: Suite, plan: NightPlan, storage: Storage, model: str, items: list[dict[str, Any]],
           out: list[str], errs: list[str], history: list[Night], run_id: str
           ) -> tuple[dict[str, Any], Night, bytes]:
    """One model's night: its score and CI, compared with its own previous night and baseline."""
    adapter = model if model != plan.model else None
    results = score_items(suite, items, out, errs)
    interval = headline(results, suite.confidence)
    prev = previous_night(history, plan.date, model)
    baseline = load_baseline(storage, plan.root, suite.name, adapter)
    max_drop = suite.thresholds.max_drop
    comparisons = [c for c in (
        compare(interval, prev.score if prev else None, against="previous", max_drop=max_drop,
                reference_date=prev.date if prev else None),
        compare(interval, baseline["score"] if baseline else None, against="baseline",
                max_drop=max_drop, reference_date=baseline.get("date") if baseline else None),
    ) if c is not None]
    regression = any(c.regression for c in comparisons)
    night = Night(plan.date, model, interval.mean, interval.low, interval.high, interval.n, run_id,
                  regression)
    if baseline is None:
        save_baseline(storage, plan.root, suite.name, night, adapter)
    judged = {"interval": interval.as_dict(), "comparisons": [c.as_dict() for c in comparisons],
              "regression": regression, "failed_requests": sum(r.error is not None for r in results),
              "previous_date": prev.date if prev else None}
    return judged, night, results_jsonl(results)


def results_uri(plan: NightPlan, model: str) -> str:
    """Per-item results of the night's model, or of one of its adapters."""
    return join_uri(plan.prefix, "results.jsonl" if model == plan.model else f"results.{model}.jsonl")


def evaluate(suite: Suite, plan: NightPlan, storage: Storage, run_id: str = "") -> dict[str, Any]:
    items = _dataset(suite, storage)
    out = storage.read_bytes(join_uri(plan.batch_output, "output.jsonl")).decode().splitlines()
    errs_uri = join_uri(plan.batch_output, "errors.jsonl")
    errs = storage.read_bytes(errs_uri).decode().splitlines() if storage.exists(errs_uri) else []
    models = night_models(suite, plan.model)
    outs, failed = split_by_model(out, models), split_by_model(errs, models)
    history = load_history(storage, plan.root, suite.name)
    per_model: dict[str, dict[str, Any]] = {}
    for model in models:
        judged, night, results = _judge(suite, plan, storage, model, items, outs[model], failed[model],
                                        history, run_id)
        storage.write_bytes(results_uri(plan, model), results)
        history = save_history(storage, plan.root, suite.name, history, night)
        registry = eval_metrics.night_registry(suite.name, model, night, history, time.time())
        if model == plan.model:
            storage.write_bytes(join_uri(plan.prefix, "metrics.prom"), eval_metrics.exposition(registry))
        judged["metrics_pushed"] = eval_metrics.push_night(registry, suite.name, model)
        per_model[model] = judged
    primary = per_model[plan.model]
    summary = {
        "suite": suite.name, "date": plan.date, "model": plan.model, "scorer": suite.scorer,
        **{k: primary[k] for k in ("interval", "comparisons", "failed_requests", "previous_date")},
        # The night is red if any model regressed; "models" says which one.
        "regression": any(j["regression"] for j in per_model.values()),
        "run_id": run_id,
        "thresholds": {"max_drop": suite.thresholds.max_drop, "min_score": suite.thresholds.min_score},
        "evaluated_at": int(time.time()), "metrics_pushed": primary["metrics_pushed"],
        # What the night's batch used and, with the deployment's prices, cost (its batch.json).
        **_spend(storage, plan),
    }
    if len(models) > 1:
        summary["models"] = per_model
    storage.write_bytes(join_uri(plan.prefix, "summary.json"), json.dumps(summary, indent=2).encode())
    return summary


def _spend(storage: Storage, plan: NightPlan) -> dict[str, Any]:
    uri = join_uri(plan.batch_output, BATCH_FILE)
    published = json.loads(storage.read_bytes(uri)) if storage.exists(uri) else {}
    return {"usage": published.get("usage"), "cost": published.get("aibrix_cost")}


def report(suite: Suite, plan: NightPlan, storage: Storage) -> dict[str, Any]:
    summary = json.loads(storage.read_bytes(join_uri(plan.prefix, "summary.json")))
    results = [json.loads(x) for x in storage.read_bytes(join_uri(plan.prefix, "results.jsonl")).splitlines()]
    from aibrix_operators.evaluation.scoring import ItemResult

    tonight = [ItemResult(**r) for r in results]
    previous: list[dict[str, Any]] = []
    if summary["previous_date"]:
        prev_uri = join_uri(night_prefix(plan.root, suite.name, summary["previous_date"]), "results.jsonl")
        if storage.exists(prev_uri):
            previous = [json.loads(x) for x in storage.read_bytes(prev_uri).splitlines()]
    history = load_history(storage, plan.root, suite.name)
    data = ReportData(
        suite=suite.name, date=plan.date, model=plan.model, scorer=suite.scorer,
        interval=Interval(**summary["interval"]),
        comparisons=[Comparison(**c) for c in summary["comparisons"]],
        history=[n for n in history if n.model == plan.model],
        regressed_items=regressed_items(tonight, previous),
        failed_requests=summary["failed_requests"], max_drop=suite.thresholds.max_drop,
        min_score=suite.thresholds.min_score,
        models=[ModelRow(model, Interval(**judged["interval"]),
                         [Comparison(**c) for c in judged["comparisons"]], model != plan.model)
                for model, judged in (summary.get("models") or {}).items()],
        usage=summary.get("usage"), cost=summary.get("cost"),
    )
    png = trend_png(data.history)
    storage.write_bytes(join_uri(plan.prefix, "trend.png"), png)
    storage.write_bytes(join_uri(plan.prefix, "report.md"), render_markdown(data).encode())
    storage.write_bytes(join_uri(plan.prefix, "report.html"), render_html(data, png).encode())
    return {"report": join_uri(plan.prefix, "report.html"), "regression": data.regression,
            "score": data.interval.mean, "regressed_items": len(data.regressed_items)}
