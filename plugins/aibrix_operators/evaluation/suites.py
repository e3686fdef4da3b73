"""Eval suites from YAML, and rendering a suite's dataset into an OpenAI Batch file.

A suite is declared by the deployment (a file in the repo, not a DAG param): its dataset (JSONL
with ``prompt`` or ``messages`` plus ``reference``), prompt template, model(s), sampling
parameters, scorer and thresholds, and its cron schedule. Pure Python, no Airflow.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The deployment's project folder (config/eval_suites.yaml, the datasets under examples/): an
# image sets AIBRIX_PROJECT_ROOT, since an installed package's own path says nothing about it;
# a source checkout is found from this file.
REPO_ROOT = Path(os.environ.get("AIBRIX_PROJECT_ROOT") or Path(__file__).resolve().parents[3])
DEFAULT_CONFIG = REPO_ROOT / "config" / "eval_suites.yaml"
DEFAULT_SCHEDULE = "0 2 * * *"


@dataclass(frozen=True)
class Thresholds:
    max_drop: float = 0.05  # absolute drop in the headline score that counts as a regression
    min_score: float | None = None  # informational floor shown in the report


@dataclass(frozen=True)
class Suite:
    name: str
    dataset: str
    scorer: str
    models: tuple[str, ...]
    prompt_template: str = "{prompt}"
    system_prompt: str | None = None
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0, "max_tokens": 16})
    scorer_options: dict[str, Any] = field(default_factory=dict)
    thresholds: Thresholds = Thresholds()
    schedule: str = DEFAULT_SCHEDULE
    confidence: float = 0.95
    description: str = ""

    def dataset_path(self) -> str:
        """Relative dataset paths are relative to the repository (s3:// URIs pass through)."""
        if "://" in self.dataset or Path(self.dataset).is_absolute():
            return self.dataset
        return str(REPO_ROOT / self.dataset)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dataset": self.dataset, "scorer": self.scorer,
                "models": list(self.models), "prompt_template": self.prompt_template,
                "system_prompt": self.system_prompt, "sampling": self.sampling,
                "scorer_options": self.scorer_options,
                "thresholds": {"max_drop": self.thresholds.max_drop,
                               "min_score": self.thresholds.min_score},
                "schedule": self.schedule, "confidence": self.confidence}


class SuiteConfigError(ValueError):
    pass


def load_suites(path: Path | str = DEFAULT_CONFIG) -> dict[str, Suite]:
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("suites"), dict):
        raise SuiteConfigError(f"{path}: expected a mapping with a 'suites' mapping")
    defaults = raw.get("defaults") or {}
    suites = {}
    for name, body in raw["suites"].items():
        merged = {**defaults, **(body or {})}
        unknown = set(merged) - {f for f in Suite.__dataclass_fields__ if f != "name"} - {"model"}
        if unknown:
            raise SuiteConfigError(f"suite {name}: unknown keys {sorted(unknown)}")
        models = merged.pop("models", None) or [merged.pop("model", None)]
        if not all(isinstance(m, str) and m for m in models):
            raise SuiteConfigError(f"suite {name}: needs models (a list of served model names)")
        for required in ("dataset", "scorer"):
            if required not in merged:
                raise SuiteConfigError(f"suite {name}: missing {required}")
        thresholds = Thresholds(**(merged.pop("thresholds", None) or {}))
        suites[name] = Suite(name=name, models=tuple(models), thresholds=thresholds, **merged)
    return suites


def read_dataset(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "reference" not in item or not ("prompt" in item or "messages" in item):
            raise SuiteConfigError(f"dataset line {number}: needs reference and prompt or messages")
        item.setdefault("id", f"item-{number:06d}")
        yield item


def render_messages(suite: Suite, item: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in item:
        messages = list(item["messages"])
    else:
        fields = {k: v for k, v in item.items() if isinstance(v, str | int | float)}
        messages = [{"role": "user", "content": suite.prompt_template.format(**fields)}]
    if suite.system_prompt:
        messages.insert(0, {"role": "system", "content": suite.system_prompt})
    return messages


def render_batch(suite: Suite, items: Iterable[dict[str, Any]], model: str) -> Iterator[str]:
    """One chat-completions request per item; custom_id is the item's id, so answers map back."""
    for item in items:
        body = {"model": model, "messages": render_messages(suite, item), **suite.sampling}
        yield json.dumps({"custom_id": str(item["id"]), "method": "POST",
                          "url": "/v1/chat/completions", "body": body}) + "\n"
