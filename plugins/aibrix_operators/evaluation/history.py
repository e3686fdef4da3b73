"""A suite's history of nights and its stored baseline, kept beside the reports.

Layout under the eval root (local directory or ``s3://bucket/prefix``)::

    eval/<suite>/history.jsonl          one line per successful night (the trend, and "last night")
    eval/<suite>/baseline.json          the score a night is also compared with
    eval/<suite>/<date>/                results.jsonl, summary.json, report.html, report.md, batch/

One ``history.jsonl`` object instead of listing every night's folder: a year of nights is one
read. A night rerun replaces its own line. The baseline is written by the first successful night
unless the suite's operators store one (promote a night by copying its summary's score there).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from aibrix_operators.storage import Storage, join_uri


@dataclass(frozen=True)
class Night:
    date: str
    model: str
    score: float
    low: float
    high: float
    n: int
    run_id: str = ""
    regression: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def suite_prefix(root: str, suite: str) -> str:
    return join_uri(root, "eval", suite)


def night_prefix(root: str, suite: str, date: str) -> str:
    return join_uri(root, "eval", suite, date)


def load_history(storage: Storage, root: str, suite: str) -> list[Night]:
    uri = join_uri(suite_prefix(root, suite), "history.jsonl")
    if not storage.exists(uri):
        return []
    nights = [Night(**json.loads(line)) for line in storage.read_bytes(uri).decode().splitlines()
              if line.strip()]
    return sorted(nights, key=lambda n: n.date)


def save_history(storage: Storage, root: str, suite: str, nights: list[Night], tonight: Night) -> list[Night]:
    kept = [n for n in nights if not (n.date == tonight.date and n.model == tonight.model)]
    updated = sorted([*kept, tonight], key=lambda n: n.date)
    data = "".join(json.dumps(n.as_dict()) + "\n" for n in updated).encode()
    storage.write_bytes(join_uri(suite_prefix(root, suite), "history.jsonl"), data)
    return updated


def previous_night(nights: list[Night], date: str, model: str) -> Night | None:
    """The latest successful night before ``date`` for the same model."""
    earlier = [n for n in nights if n.date < date and n.model == model]
    return earlier[-1] if earlier else None


def _baseline_uri(root: str, suite: str, adapter: str | None) -> str:
    # The night's model keeps baseline.json; each LoRA adapter evaluated beside it has its own.
    name = f"baseline.{adapter}.json" if adapter else "baseline.json"
    return join_uri(suite_prefix(root, suite), name)


def load_baseline(
    storage: Storage, root: str, suite: str, adapter: str | None = None
) -> dict[str, Any] | None:
    uri = _baseline_uri(root, suite, adapter)
    return json.loads(storage.read_bytes(uri)) if storage.exists(uri) else None


def save_baseline(storage: Storage, root: str, suite: str, night: Night, adapter: str | None = None
                  ) -> dict[str, Any]:
    baseline = {"score": night.score, "date": night.date, "model": night.model,
                "source": "first successful night"}
    storage.write_bytes(_baseline_uri(root, suite, adapter), json.dumps(baseline, indent=2).encode())
    return baseline
