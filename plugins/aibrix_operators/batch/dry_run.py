"""A dry run's answer (``POST /v1/batches/estimate``): the work the client counted, the estimate at
the deployment's measured rate (batch/admission.py) and what it would cost (batch/cost.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from aibrix_operators.batch.admission import Estimate, Work
from aibrix_operators.batch.cost import Prices, cost_line

BYTES_BASIS = "estimated from bytes at the measured tokens per byte (the file's text stays with the client)"
NO_STATE = ("this deployment keeps no measured rates ([aibrix_batch] state_root is not set): no estimate")


def dry_run_answer(model: str, endpoint: str, window: str, work: Work, judged: Estimate | None,
                   prices: Prices | None, tokens_basis: str | None = None) -> dict[str, Any]:
    """``tokens_basis``: what the input-token figure rests on (the model's tokenizer, or bytes, and
    why); the client's dry run, which sends no text, counts bytes only."""
    estimate = judged.as_dict() if judged is not None else Estimate(basis=NO_STATE).as_dict()
    usage = None
    if judged is not None and judged.input_tokens is not None and judged.output_tokens is not None:
        # What the batch would use at most, in usage's shape: cached input is not known ahead, so none.
        usage = {"input_tokens": judged.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": judged.output_tokens}
    return {"object": "batch.estimate", "model": model, "endpoint": endpoint, "completion_window": window,
            "work": asdict(work), "input_tokens_basis": tokens_basis or BYTES_BASIS, "estimate": estimate,
            "cost": cost_line(usage, prices)}
