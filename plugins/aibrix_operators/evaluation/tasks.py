"""Synthetic tasks: the shipped eval suites and the small model's training data come from here.

One source for both so the prompt wording the model learns is exactly the wording the suites
ask. Pure Python (no Airflow, no torch): the training script runs in the inference env, the
suites' datasets are rendered by ``scripts/make_eval_datasets.py`` in either env.

Held out: an item of a suite's dataset is never a training example (``training_examples``
skips every prompt in ``eval_prompts``), so the arithmetic score measures generalisation,
not recall. The short-answer suite is recall by design (facts, like a knowledge quiz).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                "seventeen", "eighteen", "nineteen", "twenty"]
LETTERS = "ABCD"


def arithmetic_item(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", str(a + b)


def worked_sum(prompt: str) -> str:
    """The answer the model is taught for an addition: column by column from the units, carries
    included, then the total — "7+5=12, 9+2+1=12, so the answer is 122." A model this small does
    not learn to emit a carried sum's first digit before its last in a few CPU-minutes; writing
    the columns first makes every step a one-digit lookup (scorers read "answer is N")."""
    a, b = (int(x) for x in prompt.removeprefix("What is ").removesuffix("?").split(" + "))
    steps, carry = [], 0
    for da, db in zip(f"{a:02d}"[::-1], f"{b:02d}"[::-1], strict=True):
        total = int(da) + int(db) + carry
        steps.append(f"{da}+{db}{'+1' if carry else ''}={total}")
        carry = total // 10
    return f"{', '.join(steps)}, so the answer is {a + b}."


def choice_item(rng: random.Random) -> tuple[str, str]:
    """Which option is the largest number: the answer is its letter."""
    values = rng.sample(range(100), 4)
    options = " ".join(f"{letter}) {v}" for letter, v in zip(LETTERS, values, strict=True))
    return f"Which is the largest? {options}", LETTERS[values.index(max(values))]


def short_answer_items() -> list[tuple[str, str]]:
    items = [(f"What day comes after {d}?", DAYS[(i + 1) % 7]) for i, d in enumerate(DAYS)]
    items += [(f"What month comes after {m}?", MONTHS[(i + 1) % 12]) for i, m in enumerate(MONTHS)]
    items += [(f"Write {n} in words.", w) for n, w in enumerate(NUMBER_WORDS)]
    return items


def suite_items(task: str, n: int, seed: int) -> list[tuple[str, str]]:
    """A suite's (prompt, reference) pairs: distinct prompts, deterministic for a seed."""
    if task == "short_answer":
        return short_answer_items()[:n]
    make = {"arithmetic": arithmetic_item, "multiple_choice": choice_item}[task]
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    while len(seen) < n:
        prompt, ref = make(rng)
        seen.setdefault(prompt, ref)
    return list(seen.items())


# The shipped suites' datasets: task, size, seed (scripts/make_eval_datasets.py writes them).
SHIPPED_DATASETS = {"arithmetic": ("arithmetic", 200, 1001),
                    "multiple_choice": ("multiple_choice", 100, 1002),
                    "short_answer": ("short_answer", 40, 0)}


def eval_prompts() -> set[str]:
    return {p for task, n, seed in SHIPPED_DATASETS.values() if task != "short_answer"
            for p, _ in suite_items(task, n, seed)}


def training_examples(seed: int, held_out: set[str]) -> Iterator[tuple[str, str]]:
    """An endless mix of the three tasks as (prompt, target text); arithmetic and multiple-choice
    items from the suites are skipped, short answers (facts) are all taught."""
    rng = random.Random(seed)
    facts = short_answer_items()
    while True:
        r = rng.random()
        if r < 0.7:
            prompt, _ = arithmetic_item(rng)
            item = (prompt, worked_sum(prompt))
        elif r < 0.9:
            item = choice_item(rng)
        else:
            item = rng.choice(facts)
        if item[0] not in held_out:
            yield item
