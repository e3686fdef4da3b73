"""Score a batch's answers against a suite's references: per-item results and the headline score."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from aibrix_operators.evaluation.scorers import get_scorer
from aibrix_operators.evaluation.stats import Interval, bootstrap_ci
from aibrix_operators.evaluation.suites import Suite


@dataclass
class ItemResult:
    id: str
    reference: str
    answer: str | None
    extracted: str | None
    score: float
    error: str | None = None  # the batch's error line, when the request got no answer

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def answer_of(record: dict[str, Any]) -> str | None:
    """The assistant's text in an OpenAI batch output line (chat or completions)."""
    try:
        choice = record["response"]["body"]["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(choice.get("message"), dict):
        return choice["message"].get("content") or ""
    return choice.get("text")


def score_items(suite: Suite, items: Iterable[dict[str, Any]], outputs: Iterable[str],
                errors: Iterable[str]) -> list[ItemResult]:
    """Every dataset item gets a result; one the batch did not answer scores 0 with its error."""
    answers: dict[str, str | None] = {}
    for line in outputs:
        if line.strip():
            record = json.loads(line)
            answers[record["custom_id"]] = answer_of(record)
    failures: dict[str, str] = {}
    for line in errors:
        if line.strip():
            record = json.loads(line)
            err = record.get("error") or {}
            failures[record["custom_id"]] = f"{err.get('code')}: {err.get('message', '')}"[:300]
    scorer = get_scorer(suite.scorer, suite.scorer_options)
    results = []
    for item in items:
        cid, ref = str(item["id"]), str(item["reference"])
        answer = answers.get(cid)
        if answer is None:
            results.append(ItemResult(cid, ref, None, None, 0.0,
                                      failures.get(cid, "no answer in the batch output")))
            continue
        score = scorer(answer, ref)
        results.append(ItemResult(cid, ref, answer, score.extracted, score.value))
    return results


def headline(results: list[ItemResult], confidence: float, seed: int = 0) -> Interval:
    return bootstrap_ci([r.score for r in results], confidence=confidence, seed=seed)


def results_jsonl(results: list[ItemResult]) -> bytes:
    return "".join(json.dumps(r.as_dict(), ensure_ascii=False) + "\n" for r in results).encode()
