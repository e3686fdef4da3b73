"""Write docs/eval-report.png: the arithmetic suite's report after 14 good nights and one night of
the degraded checkpoint. The suite, scoring, comparisons and report are the real code on local
storage; the answers are synthetic (right at the rates measured for eval-llama: 100% and 35%).

    .venv/bin/python scripts/demo_eval_report.py [OUT.png]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))
sys.path.insert(0, str(REPO / "scripts"))

from screenshot_report import screenshot  # noqa: E402

from aibrix_operators.evaluation import steps  # noqa: E402
from aibrix_operators.evaluation.suites import load_suites  # noqa: E402
from aibrix_operators.storage import LocalStorage  # noqa: E402


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else REPO / "docs" / "eval-report.png"
    suite = load_suites()["arithmetic"]
    items = [json.loads(x) for x in Path(suite.dataset_path()).read_text().splitlines()]
    rng = random.Random(3)
    root = Path(tempfile.mkdtemp())
    storage = LocalStorage()
    for day in range(1, 16):
        plan = steps.NightPlan("arithmetic", f"2026-11-{day:02d}", "eval-llama", str(root))
        steps.render(suite, plan, storage)
        p = 0.35 if day == 15 else 1.0 - rng.choice([0, 0, 0.005, 0.01])
        lines = []
        for it in items:
            ref = int(it["reference"])
            got = ref if rng.random() < p else ref + rng.choice([-10, 1, 10])
            lines.append(json.dumps({"custom_id": it["id"], "error": None, "response": {
                "status_code": 200, "body": {"choices": [{"message": {
                    "role": "assistant", "content": f"so the answer is {got}."}}]}}}))
        Path(plan.batch_output, "output.jsonl").write_text("\n".join(lines) + "\n")
        Path(plan.batch_output, "errors.jsonl").write_text("")
        steps.evaluate(suite, plan, storage)
        steps.report(suite, plan, storage)
    screenshot(Path(plan.prefix) / "report.html", out, 1000, 1100)
    print(f"wrote {out} from {plan.prefix}")


if __name__ == "__main__":
    main(sys.argv[1:])
