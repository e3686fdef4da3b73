"""Nightly-eval speed: scoring 100,000 items (target < 10 s) and rendering a report over 365
nights of history (target < 5 s), on the real code paths (steps.evaluate / steps.report over
local storage), with realistic prose answers.

    .venv/bin/python bench/eval_scoring.py            # prints measured vs target
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))

from aibrix_operators.evaluation import steps  # noqa: E402
from aibrix_operators.evaluation.history import Night, save_history  # noqa: E402
from aibrix_operators.evaluation.suites import Suite, Thresholds  # noqa: E402
from aibrix_operators.storage import LocalStorage  # noqa: E402

SCORING_TARGET_S = 10.0
REPORT_TARGET_S = 5.0


def _answer(cid: str, text: str) -> str:
    return json.dumps({"id": "r", "custom_id": cid, "error": None, "response": {"status_code": 200,
                       "body": {"choices": [{"message": {"role": "assistant", "content": text}}]}}})


def setup(root: Path, items: int, nights: int, scorer: str) -> tuple[Suite, steps.NightPlan]:
    rng = random.Random(0)
    dataset = root / "ds.jsonl"
    refs = [str(rng.randint(0, 198)) for _ in range(items)]
    dataset.write_text("".join(json.dumps({"id": f"i{i}", "prompt": "p", "reference": r}) + "\n"
                               for i, r in enumerate(refs)))
    suite = Suite(name="bench", dataset=str(dataset), scorer=scorer, models=("m",),
                  thresholds=Thresholds(max_drop=0.05))
    start = date(2025, 1, 1)
    storage = LocalStorage()
    history = [Night((start + timedelta(days=d)).isoformat(), "m", 0.9 + rng.uniform(-0.02, 0.02),
                     0.88, 0.92, items) for d in range(nights - 1)]
    save_history(storage, str(root), "bench", [], history[0])
    (root / "eval" / "bench" / "history.jsonl").write_text("".join(json.dumps(n.as_dict()) + "\n"
                                                                   for n in history))
    tonight = (start + timedelta(days=nights - 1)).isoformat()
    plan = steps.NightPlan("bench", tonight, "m", str(root))
    out = Path(plan.batch_output)
    out.mkdir(parents=True)
    lines = [_answer(f"i{i}", f"3+4=7, 1+2=3, so the answer is {r if rng.random() < 0.9 else 0}.")
             for i, r in enumerate(refs)]
    (out / "output.jsonl").write_text("\n".join(lines) + "\n")
    (out / "errors.jsonl").write_text("")
    # the previous night's per-item results, so the report computes regressed items too
    prev = Path(steps.night_prefix(str(root), "bench", history[-1].date))
    prev.mkdir(parents=True)
    (prev / "results.jsonl").write_text("".join(json.dumps({"id": f"i{i}", "score": 1.0, "answer": r}) + "\n"
                                                for i, r in enumerate(refs)))
    return suite, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--nights", type=int, default=365)
    parser.add_argument("--scorer", default="numeric")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        suite, plan = setup(Path(tmp), args.items, args.nights, args.scorer)
        storage = LocalStorage()
        t0 = time.perf_counter()
        summary = steps.evaluate(suite, plan, storage)
        scoring = time.perf_counter() - t0
        t0 = time.perf_counter()
        steps.report(suite, plan, storage)
        report = time.perf_counter() - t0
    print(f"score {args.items:,} items ({args.scorer}, bootstrap CI, compare, write): {scoring:.2f} s "
          f"(target < {SCORING_TARGET_S:.0f} s) score={summary['interval']['mean']:.3f}")
    print(f"report over {args.nights} nights (trend PNG, HTML, Markdown): {report:.2f} s "
          f"(target < {REPORT_TARGET_S:.0f} s)")
    ok = scoring < SCORING_TARGET_S and report < REPORT_TARGET_S
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
