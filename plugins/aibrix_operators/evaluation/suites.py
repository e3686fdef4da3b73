"""Eval suites from YAML, and rendering a suite's dataset into an OpenAI Batch file.

A suite is declared by the deployment (a file in the repo, not a DAG param): its dataset (JSONL
with ``prompt`` or ``messages`` plus ``reference``), prompt template, model(s), sampling
parameters, scorer and thresholds, its cron schedule and the Assets whose events also start it.
Pure Python, no Airflow.
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
    # LoRA adapters of the night's model, evaluated beside it in the same batch (docs/lora.md):
    # the report shows them side by side, and each has its own history, baseline and gate.
    adapters: tuple[str, ...] = ()
    # Asset URIs whose events start a run too, besides the cron schedule: e.g. the Asset a
    # fine-tuning DAG updates when it publishes a new checkpoint (dags/nightly_eval.py).
    on_assets: tuple[str, ...] = ()

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
                "schedule": self.schedule, "confidence": self.confidence,
                "adapters": list(self.adapters), "on_assets": list(self.on_assets)}


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
        adapters = merged.pop("adapters", None) or []
        if not (isinstance(adapters, list) and all(isinstance(a, str) and a for a in adapters)) \
                or set(adapters) & set(models):
            raise SuiteConfigError(f"suite {name}: adapters must be a list of LoRA adapter names, "
                                   "none of them one of its models")
        on_assets = merged.pop("on_assets", None) or []
        if not (isinstance(on_assets, list) and all(isinstance(a, str) and "://" in a for a in on_assets)):
            raise SuiteConfigError(f"suite {name}: on_assets must be a list of Asset URIs "
                                   "(scheme://path, as the producing DAG's outlet names them)")
        suites[name] = Suite(name=name, models=tuple(models), thresholds=thresholds,
                             adapters=tuple(adapters), on_assets=tuple(on_assets), **merged)
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


# A night with adapters asks every item of every model in one batch; custom_id is then
# "<model>::<item id>" (split_by_model takes the answers apart again).
MODEL_SEPARATOR = "::"


def night_models(suite: Suite, model: str) -> tuple[str, ...]:
    """The models a night evaluates: the night's model, then the suite's adapters of it."""
    return (model, *suite.adapters)


def render_batch(suite: Suite, items: Iterable[dict[str, Any]], model: str) -> Iterator[str]:
    """One chat-completions request per item and model; custom_id is the item's id (prefixed with
    the model when the suite has adapters), so answers map back."""
    items = list(items)
    models = night_models(suite, model)
    for name in models:
        for item in items:
            body = {"model": name, "messages": render_messages(suite, item), **suite.sampling}
            cid = f"{name}{MODEL_SEPARATOR}{item['id']}" if len(models) > 1 else str(item["id"])
            yield json.dumps({"custom_id": cid, "method": "POST",
                              "url": "/v1/chat/completions", "body": body}) + "\n"


def split_by_model(lines: list[str], models: tuple[str, ...]) -> dict[str, list[str]]:
    """Output or error lines per model, custom_id back to the item's id (one model: as they are)."""
    if len(models) == 1:
        return {models[0]: lines}
    per: dict[str, list[str]] = {m: [] for m in models}
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        model, _, item_id = str(record.get("custom_id", "")).partition(MODEL_SEPARATOR)
        if model in per:
            record["custom_id"] = item_id
            per[model].append(json.dumps(record))
    return per
