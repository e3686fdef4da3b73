"""Eval scores as Prometheus metrics, pushed by the (short-lived) evaluate task.

A night is one push to the Pushgateway (``AIBRIX_PUSHGATEWAY_URL``), grouped by suite and model
so each suite's series replace their own last values. ``aibrix_eval_regressions_total`` counts
regressed nights from the suite's history, so it only ever grows (a counter, rate()-able) even
though each push is a fresh process. Labels: suite and model — a handful of each.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from aibrix_operators.evaluation.history import Night

log = logging.getLogger(__name__)


def night_registry(suite: str, model: str, tonight: Night, history: list[Night],
                   at: float) -> CollectorRegistry:
    reg = CollectorRegistry()
    labels = {"suite": suite, "model": model}
    for name, doc, value in (
        ("aibrix_eval_score", "Headline score of the suite's last night (0..1).", tonight.score),
        ("aibrix_eval_score_ci_low", "Lower end of the score's bootstrap interval.", tonight.low),
        ("aibrix_eval_score_ci_high", "Upper end of the score's bootstrap interval.", tonight.high),
        ("aibrix_eval_items", "Items scored on the last night.", tonight.n),
        ("aibrix_eval_regression", "1 if the last night regressed, else 0.", float(tonight.regression)),
        ("aibrix_eval_last_run_timestamp_seconds", "When the last night was scored (Unix time).", at),
    ):
        Gauge(name, doc, list(labels), registry=reg).labels(**labels).set(value)
    regressions = Counter("aibrix_eval_regressions", "Nights flagged as regressions.", list(labels),
                          registry=reg)
    regressions.labels(**labels).inc(sum(n.regression for n in history if n.model == model))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)


def push_night(reg: CollectorRegistry, suite: str, model: str) -> bool:
    url = os.environ.get("AIBRIX_PUSHGATEWAY_URL")
    if not url:
        return False
    from prometheus_client import push_to_gateway

    try:
        push_to_gateway(url, job="aibrix_eval", registry=reg, grouping_key={"suite": suite, "model": model},
                        timeout=5)
        return True
    except Exception as exc:  # noqa: BLE001 - a metrics outage must not fail the eval
        log.warning("could not push eval metrics to %s: %s", url, exc)
        return False
