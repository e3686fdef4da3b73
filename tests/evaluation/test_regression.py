"""Bootstrap intervals and regression detection on synthetic score histories, and the eval steps
(render → evaluate → report) over local storage with a hand-made batch output."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowFailException

from aibrix_operators.evaluation import steps
from aibrix_operators.evaluation.history import Night, load_history, previous_night
from aibrix_operators.evaluation.stats import bootstrap_ci, compare
from aibrix_operators.evaluation.suites import Suite, SuiteConfigError, Thresholds, load_suites
from aibrix_operators.operators.eval_tasks import regression_gate
from aibrix_operators.storage import LocalStorage


def scores(p: float, n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < p).astype(float)


def test_bootstrap_interval_covers_the_mean_and_narrows_with_n():
    small, large = bootstrap_ci(scores(0.8, 50)), bootstrap_ci(scores(0.8, 5000))
    for iv in (small, large):
        assert iv.low <= iv.mean <= iv.high
    assert (large.high - large.low) < (small.high - small.low) / 5
    assert bootstrap_ci([1.0] * 30).low == 1.0  # no variance, no interval
    cont = bootstrap_ci(np.linspace(0, 1, 101))  # non-binary scores take the resampling path
    assert cont.low < 0.5 < cont.high


@pytest.mark.parametrize(("history", "tonight", "max_drop", "expected"), [
    # a clear drop, beyond the threshold and the interval
    ([0.92, 0.93, 0.91], scores(0.60, 200), 0.05, True),
    # a small, noise-sized dip: no
    ([0.92, 0.93, 0.91], scores(0.89, 200, 1), 0.05, False),
    # significant (n huge) but under the threshold: no
    ([0.92, 0.92, 0.92], scores(0.90, 100_000), 0.05, False),
    # beyond the threshold but a 10-item suite's interval covers it: noise, no
    ([0.90, 0.90, 0.90], np.array([1.0] * 8 + [0.0] * 2), 0.05, False),
    # improvement: never
    ([0.50, 0.55], scores(0.9, 200), 0.05, False),
])
def test_regression_needs_both_threshold_and_interval(history, tonight, max_drop, expected):
    iv = bootstrap_ci(tonight)
    result = compare(iv, history[-1], against="previous", max_drop=max_drop)
    assert result is not None
    assert result.regression is expected, result.reason
    assert compare(iv, None, against="baseline", max_drop=max_drop) is None


def test_previous_night_skips_other_models_and_later_nights():
    nights = [Night("2026-11-01", "m", 0.9, 0.85, 0.95, 100), Night("2026-11-02", "other", 0.1, 0, 0.2, 100),
              Night("2026-11-04", "m", 0.7, 0.6, 0.8, 100)]
    assert previous_night(nights, "2026-11-03", "m").date == "2026-11-01"
    assert previous_night(nights, "2026-11-01", "m") is None


def addition_dataset(tmp_path: Path, n: int = 100) -> Path:
    dataset = tmp_path / "ds.jsonl"
    items = [{"id": f"i{i}", "prompt": f"What is {i} + 1?", "reference": str(i + 1)} for i in range(n)]
    dataset.write_text("".join(json.dumps(item) + "\n" for item in items))
    return dataset


def _suite(dataset: Path) -> Suite:
    return Suite(name="arith", dataset=str(dataset), scorer="numeric", models=("m",),
                 prompt_template="Q: {prompt}", thresholds=Thresholds(max_drop=0.05, min_score=0.8))


def _answer(cid: str, text: str) -> str:
    return json.dumps({"id": "x", "custom_id": cid, "error": None, "response": {
        "status_code": 200, "body": {"choices": [{"message": {"role": "assistant", "content": text}}]}}})


def _night(tmp_path: Path, suite: Suite, date: str, right: int, total: int = 100) -> dict:
    storage = LocalStorage()
    plan = steps.NightPlan(suite.name, date, "m", str(tmp_path / "root"))
    rendered = steps.render(suite, plan, storage)
    lines = [json.loads(x) for x in Path(rendered["input_uri"]).read_text().splitlines()]
    assert lines[0]["body"]["messages"] == [{"role": "user", "content": "Q: What is 0 + 1?"}]
    assert lines[0]["body"]["model"] == "m" and lines[0]["custom_id"] == "i0"
    out = Path(plan.batch_output)
    # `right` answers correct (in prose), one request failed, the rest wrong
    answers = [_answer(f"i{i}", f"The answer is {i + 1}." if i < right else "7") for i in range(total - 1)]
    (out / "output.jsonl").write_text("\n".join(answers) + "\n")
    (out / "errors.jsonl").write_text(json.dumps({"custom_id": f"i{total - 1}", "response": None,
                                                  "error": {"code": "bad", "message": "no"}}) + "\n")
    summary = steps.evaluate(suite, plan, storage, run_id=f"run-{date}")
    written = steps.report(suite, plan, storage)
    return {"summary": summary, "report": written, "prefix": Path(plan.prefix)}


@pytest.mark.service
def test_steps_over_three_nights(tmp_path):
    suite = _suite(addition_dataset(tmp_path))
    first = _night(tmp_path, suite, "2026-11-01", right=90)
    assert first["summary"]["interval"]["mean"] == pytest.approx(0.90)
    assert first["summary"]["comparisons"] == [] and first["summary"]["failed_requests"] == 1
    results = [json.loads(x) for x in (first["prefix"] / "results.jsonl").read_text().splitlines()]
    assert results[0] == {"id": "i0", "reference": "1", "answer": "The answer is 1.", "extracted": "1",
                          "score": 1.0, "error": None}
    assert results[-1]["error"] == "bad: no"

    second = _night(tmp_path, suite, "2026-11-02", right=88)
    deltas = {c["against"]: c for c in second["summary"]["comparisons"]}
    assert deltas["previous"]["delta"] == pytest.approx(-0.02)
    assert deltas["baseline"]["reference_date"] == "2026-11-01"
    assert not second["summary"]["regression"]

    third = _night(tmp_path, suite, "2026-11-03", right=50)
    assert third["summary"]["regression"] and third["report"]["regression"]
    assert third["report"]["regressed_items"] == 20  # capped at the top 20 of 38 fallen items
    html = (third["prefix"] / "report.html").read_text()
    assert "REGRESSION" in html and "data:image/png;base64," in html and "<script" not in html
    md = (third["prefix"] / "report.md").read_text()
    assert "| previous (2026-11-02) | 88.0% | -38.0 pt | **yes** |" in md
    assert "Floor 80.0%: BELOW." in md
    assert "Floor 80.0%: met." in (second["prefix"] / "report.md").read_text()
    assert (third["prefix"] / "trend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prom = (third["prefix"] / "metrics.prom").read_text()  # what the evaluate task pushes
    assert 'aibrix_eval_score{model="m",suite="arith"} 0.5' in prom
    assert 'aibrix_eval_regressions_total{model="m",suite="arith"} 1.0' in prom
    history = load_history(LocalStorage(), str(tmp_path / "root"), "arith")
    assert [(n.date, n.regression) for n in history] == [
        ("2026-11-01", False), ("2026-11-02", False), ("2026-11-03", True)]


def test_shipped_suites_config_loads_and_datasets_exist():
    suites = load_suites()
    assert {"arithmetic", "multiple_choice", "short_answer"} <= set(suites)
    for suite in suites.values():
        assert Path(suite.dataset_path()).exists()
    assert suites["multiple_choice"].schedule == "30 2 * * *"
    assert suites["arithmetic"].schedule == "0 2 * * *"


def test_suite_config_errors(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("suites:\n  x: {dataset: d.jsonl, scorer: exact, models: [m], colour: red}\n")
    with pytest.raises(SuiteConfigError, match="unknown keys"):
        load_suites(bad)
    bad.write_text("suites:\n  x: {dataset: d.jsonl, scorer: exact, models: [m], on_assets: [checkpoints]}\n")
    with pytest.raises(SuiteConfigError, match="on_assets must be a list of Asset URIs"):
        load_suites(bad)


def _adapter_night(tmp_path: Path, suite: Suite, date: str, right: dict[str, int]) -> dict:
    """A night of the model "m" and its adapter "m-lora": one batch, answers per model."""
    storage = LocalStorage()
    plan = steps.NightPlan(suite.name, date, "m", str(tmp_path / "root"))
    rendered = steps.render(suite, plan, storage)
    lines = [json.loads(x) for x in Path(rendered["input_uri"]).read_text().splitlines()]
    assert [(r["custom_id"], r["body"]["model"]) for r in (lines[0], lines[100])] == [
        ("m::i0", "m"), ("m-lora::i0", "m-lora")]
    answers = [_answer(f"{model}::i{i}", f"The answer is {i + 1}." if i < right[model] else "7")
               for model in ("m", "m-lora") for i in range(100)]
    random.Random(date).shuffle(answers)  # answers come back in any order
    (Path(plan.batch_output) / "output.jsonl").write_text("\n".join(answers) + "\n")
    summary = steps.evaluate(suite, plan, storage, run_id=f"run-{date}")
    written = steps.report(suite, plan, storage)
    return {"summary": summary, "report": written, "prefix": Path(plan.prefix)}


@pytest.mark.service
def test_adapter_beside_its_model_side_by_side_and_judged_alone(tmp_path):
    suite = replace(_suite(addition_dataset(tmp_path)), adapters=("m-lora",))
    first = _adapter_night(tmp_path, suite, "2026-11-01", {"m": 10, "m-lora": 95})
    models = first["summary"]["models"]
    assert models["m"]["interval"]["mean"] == pytest.approx(0.10)
    assert models["m-lora"]["interval"]["mean"] == pytest.approx(0.95)
    # The night's model keeps the summary's top-level fields, as without adapters.
    assert first["summary"]["interval"] == models["m"]["interval"]
    md = (first["prefix"] / "report.md").read_text()
    assert "## The model and its adapters" in md
    assert "| m-lora | adapter | 95.0% |" in md and "+85.0 pt (CIs apart)" in md
    assert (first["prefix"] / "results.m-lora.jsonl").exists()

    # The adapter gets worse, the model does not: a regression of the adapter alone.
    second = _adapter_night(tmp_path, suite, "2026-11-02", {"m": 10, "m-lora": 60})
    models = second["summary"]["models"]
    assert second["summary"]["regression"]
    assert not models["m"]["regression"] and models["m-lora"]["regression"]
    assert {c["against"] for c in models["m-lora"]["comparisons"]} == {"previous", "baseline"}
    assert "| m | model | 10.0% |" in (second["prefix"] / "report.md").read_text()
    history = load_history(LocalStorage(), str(tmp_path / "root"), "arith")
    assert [(n.date, n.model, n.regression) for n in history] == [
        ("2026-11-01", "m", False), ("2026-11-01", "m-lora", False),
        ("2026-11-02", "m", False), ("2026-11-02", "m-lora", True)]
    # Each has its own baseline.
    root = tmp_path / "root" / "eval" / "arith"
    assert json.loads((root / "baseline.m-lora.json").read_text())["score"] == pytest.approx(0.95)
    assert json.loads((root / "baseline.json").read_text())["score"] == pytest.approx(0.10)
    with pytest.raises(AirflowFailException, match=r"of m-lora: m-lora: .*drop"):
        regression_gate(second["summary"])
    regression_gate(first["summary"])  # no regression: passes


def test_suite_adapters_are_checked(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("suites:\n  x: {dataset: d.jsonl, scorer: exact, models: [m], adapters: [m]}\n")
    with pytest.raises(SuiteConfigError, match="adapters must be a list of LoRA adapter names"):
        load_suites(bad)
