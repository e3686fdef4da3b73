"""Alert rules, their unit tests, the Grafana dashboard and the eval exporter, all checked with
promtool; every metric the dashboard and rules query is one an exporter of this repo defines."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from prometheus_client import generate_latest

from aibrix_operators.batch.metrics import BatchSnapshot, registry_for
from aibrix_operators.driver import metrics as driver_metrics
from aibrix_operators.evaluation.history import Night
from aibrix_operators.evaluation.metrics import exposition, night_registry
from tests.metrics.conftest import REPO, check_metrics

MON = REPO / "monitoring"


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.service
def test_alert_rules_check_and_unit_tests(promtool):
    rules = MON / "prometheus" / "rules"
    checked = _run(str(promtool), "check", "rules", str(rules / "aibrix.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _run(str(promtool), "test", "rules", "aibrix_test.yml", cwd=rules)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


@pytest.mark.parametrize(("good", "broken", "alert"), [
    ("> 0.05", "> 0.5", "AibrixBatchErrorRate"),
    # a batch counted as stuck although drivers answer requests
    ("unless on () (sum(rate(aibrix_driver_requests_total[15m])) > 0)", "", "AibrixBatchNoProgress"),
    ("< time() - 600", "< time() - 6000", "AibrixBatchPastDeadline"),
])
@pytest.mark.service
def test_rule_unit_tests_fail_when_a_rule_is_wrong(promtool, tmp_path, good, broken, alert):
    """The rule tests are not vacuous: a broken threshold or clause makes them fail."""
    rules = MON / "prometheus" / "rules"
    text = (rules / "aibrix.yml").read_text()
    assert good in text
    (tmp_path / "aibrix.yml").write_text(text.replace(good, broken))
    (tmp_path / "aibrix_test.yml").write_text((rules / "aibrix_test.yml").read_text())
    tested = _run(str(promtool), "test", "rules", "aibrix_test.yml", cwd=tmp_path)
    assert tested.returncode != 0 and alert in tested.stdout + tested.stderr


def _dashboard() -> dict:
    return json.loads((MON / "grafana" / "dashboards" / "aibrix-batch.json").read_text())


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def test_dashboard_covers_what_operators_watch():
    """Batch progress, throughput, errors, replicas per role, KV hit rate, eval trend: each has a
    panel querying the series that measure it."""
    panels = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in _dashboard()["panels"]}
    wanted = {
        "batch progress": r"aibrix_batch_shards_done\b.*aibrix_batch_shards\b",
        "batch status": r"aibrix_batch_phase",
        "deadline": r"aibrix_batch_deadline_timestamp_seconds.*time\(\)",
        "throughput": r"rate\(aibrix_driver_requests_total",
        "errors": r'outcome="failed"',
        "replicas per role": r"by \(role\).*replicas",
        "KV hit rate": r"kvcache_lookup_hit_tokens_total.*/.*kvcache_lookup_tokens_total",
        "eval trend": r"aibrix_eval_score\b",
    }
    missing = [what for what, pattern in wanted.items()
               if not any(re.search(pattern, expr) for expr in panels.values())]
    assert not missing, missing


@pytest.mark.service
def test_dashboard_queries_parse(promtool, tmp_path):
    """promtool has no bare PromQL checker: each panel query becomes a recording rule."""
    exprs = _dashboard_exprs()
    assert len(exprs) >= 12
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "dash.yml").write_text(yaml.safe_dump(rules))
    checked = _run(str(promtool), "check", "rules", str(tmp_path / "dash.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _defined_metric_names() -> set[str]:
    names = set()
    text = generate_latest(driver_metrics.REGISTRY).decode()
    text += generate_latest(registry_for(BatchSnapshot("b", "in_progress", 1, 1, 0, 1, 1, 1.0, 2.0))).decode()
    reg = night_registry("s", "m", Night("2026-11-01", "m", 0.9, 0.8, 0.95, 10), [], 0.0)
    text += exposition(reg).decode()
    for name, kind in re.findall(r"^# TYPE (\w+) (\w+)", text, re.M):
        names.add(name + "_total" if kind == "counter" else name)
    # other components' metrics (prometheus-client appends _total to counters)
    for path in ("plugins/aibrix_operators/scaling/metrics.py", "kvcache/metrics.py"):
        src = (REPO / path).read_text()
        for kind, name in re.findall(r'(Counter|Gauge|Histogram)\(\s*"(\w+)"', src):
            names.add(name + "_total" if kind == "Counter" else name)
    return names


def test_every_queried_metric_is_exported():
    defined = _defined_metric_names()
    queried = set()
    exprs = _dashboard_exprs() + [r["expr"] for g in yaml.safe_load(
        (MON / "prometheus" / "rules" / "aibrix.yml").read_text())["groups"] for r in g["rules"]]
    for expr in exprs:
        queried |= {m for m in re.findall(r"\b(aibrix_\w+|kvcache_\w+)", expr)}
    base = {re.sub(r"_(bucket|count|sum)$", "", m) for m in queried}
    missing = {m for m in base if m not in defined and m + "_total" not in defined}
    assert not missing, missing


@pytest.mark.service
def test_eval_exposition_passes_promtool(promtool):
    history = [Night("2026-11-01", "m", 0.9, 0.85, 0.95, 200), Night("2026-11-02", "m", 0.5, 0.4, 0.6, 200,
                                                                   regression=True)]
    text = exposition(night_registry("arithmetic", "m", history[-1], history, 1.7e9)).decode()
    lint = check_metrics(promtool, text)
    assert lint.returncode == 0 and lint.stdout.strip() == "", lint.stdout + lint.stderr
    assert 'aibrix_eval_regressions_total{model="m",suite="arithmetic"} 1.0' in text
    assert 'aibrix_eval_score{model="m",suite="arithmetic"} 0.5' in text
