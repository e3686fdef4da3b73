"""Write the shipped eval suites' datasets (examples/eval/*.jsonl) from the task generators.

Deterministic: rerunning rewrites the same bytes. The small model's training skips these items.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "plugins"))

from aibrix_operators.evaluation.adapter_tasks import DATASET, reverse_fact_items  # noqa: E402
from aibrix_operators.evaluation.tasks import SHIPPED_DATASETS, suite_items  # noqa: E402


def main() -> None:
    out = REPO_ROOT / "examples" / "eval"
    out.mkdir(parents=True, exist_ok=True)
    for name, (task, n, seed) in SHIPPED_DATASETS.items():
        lines = [json.dumps({"id": f"{name}-{i:04d}", "prompt": p, "reference": r})
                 for i, (p, r) in enumerate(suite_items(task, n, seed))]
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{name}: {len(lines)} items")
    # The LoRA adapter's task (evaluation/adapter_tasks.py): recall of facts, like short_answer.
    lines = [json.dumps({"id": f"{DATASET}-{i:04d}", "prompt": p, "reference": r})
             for i, (p, r) in enumerate(reverse_fact_items())]
    (out / f"{DATASET}.jsonl").write_text("\n".join(lines) + "\n")
    print(f"{DATASET}: {len(lines)} items")


if __name__ == "__main__":
    main()
