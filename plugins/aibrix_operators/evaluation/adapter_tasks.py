"""The task the eval suites' LoRA adapter teaches: facts the base model was never taught.

The base eval model (``train_eval_model.py``) learns successors: the day after Monday, the
month after May, numbers written as words. ``eval-llama-reverse``
(``train_eval_adapter.py``) is a LoRA adapter of it that learns the reverse: the day *before*,
the month *before*, and a number word back to digits. The base scores near zero on these, so
the suite ``reverse_facts`` shows what an adapter adds, side by side with its base.

Its own module, not ``tasks.py``: the base model's training cache is keyed on that file, and
adding the adapter's task must not retrain the base.
"""

from __future__ import annotations

from aibrix_operators.evaluation.tasks import DAYS, MONTHS, NUMBER_WORDS

DATASET = "reverse_facts"


def reverse_fact_items() -> list[tuple[str, str]]:
    items = [(f"What day comes before {d}?", DAYS[(i - 1) % 7]) for i, d in enumerate(DAYS)]
    items += [(f"What month comes before {m}?", MONTHS[(i - 1) % 12]) for i, m in enumerate(MONTHS)]
    items += [(f"Write {w} in digits.", str(n)) for n, w in enumerate(NUMBER_WORDS)]
    return items
