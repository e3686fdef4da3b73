"""What a batch cost, in the units a finance team uses: the deployment's prices times its usage.

The deployment sets the prices (``[aibrix_batch] prices``; nothing a batch's submitter sends)::

    [aibrix_batch]
    prices = input=0.50, cached=0.25, output=1.50, gpu_hour=2.40, currency=USD

``input``, ``cached`` and ``output`` are per million tokens; ``cached`` is the price of an input
token the server found in its prefix cache (OpenAI's ``cached_tokens``; unset: the input price).
``gpu_hour`` is the price of an hour of the endpoint's engine, charged for the engine time the
batch used (its share of the endpoint's tokens while each shard ran, ``driver/engine_time.py``);
unset, or an endpoint that does not report its token counters: no engine line.

The cost line (``cost_line``) is in ``batch.json`` and the Batch API's object (``aibrix_cost``, live
while the batch runs, without engine time until the end), the CLI's ``status`` and the nightly
eval's report. Without prices there is no cost line, only ``usage``. Core: no Airflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MILLION = 1_000_000
_KEYS = ("input", "cached", "output", "gpu_hour")


class PricesError(ValueError):
    """The deployment's ``prices`` setting is malformed; the message names the item."""


@dataclass(frozen=True)
class Prices:
    """Prices per million tokens."""

    input: float
    output: float
    cached: float | None = None  # None: cached input tokens cost what input tokens cost
    currency: str = "USD"
    gpu_hour: float | None = None  # per hour of engine time; None: not charged

    @property
    def cached_or_input(self) -> float:
        return self.input if self.cached is None else self.cached


def parse_prices(text: str | None) -> Prices | None:
    """``input=0.50, cached=0.25, output=1.50, currency=USD`` → Prices; unset or empty: None."""
    if not (text or "").strip():
        return None
    values: dict[str, float] = {}
    currency = "USD"
    for item in str(text).split(","):
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise PricesError(f"[aibrix_batch] prices: {item.strip()!r} is not key=value "
                              "(keys: input, cached, output per million tokens, currency)")
        if key == "currency":
            if not raw.isascii() or not raw.isalpha() or len(raw) != 3:
                raise PricesError(f"[aibrix_batch] prices: currency {raw!r} is not a 3-letter code like USD")
            currency = raw.upper()
            continue
        if key not in _KEYS:
            raise PricesError(f"[aibrix_batch] prices: unknown key {key!r} (input, cached, output, gpu_hour, "
                              "currency)")
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not math.isfinite(value) or value < 0:
            raise PricesError(f"[aibrix_batch] prices: {key}={raw!r} is not a price >= 0 per million tokens")
        values[key] = value
    if "input" not in values or "output" not in values:
        raise PricesError("[aibrix_batch] prices must set at least input= and output= (per million tokens)")
    return Prices(values["input"], values["output"], values.get("cached"), currency, values.get("gpu_hour"))


def _count(usage: dict[str, Any], key: str, detail: str | None = None) -> int:
    value = (usage.get(key) or {}).get(detail) if detail else usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def cost_line(usage: dict[str, Any] | None, prices: Prices | None,
              engine_s: float | None = None) -> dict[str, Any] | None:
    """The batch's cost from its ``usage`` (OpenAI's shape) at ``prices``, or None without either.

    Amounts are in ``currency``, rounded to a millionth; ``cached_share`` is the share of input
    tokens served from the prefix cache (what prefix-aware batching saves). ``engine_s``: the engine
    time the batch used, if known: ``engine_hours`` on the line, and ``engine`` at ``gpu_hour``."""
    if usage is None or prices is None:
        return None
    inputs = _count(usage, "input_tokens")
    cached = min(_count(usage, "input_tokens_details", "cached_tokens"), inputs)
    outputs = _count(usage, "output_tokens")
    amounts = {"input": (inputs - cached) * prices.input / MILLION,
               "cached_input": cached * prices.cached_or_input / MILLION,
               "output": outputs * prices.output / MILLION}
    hours = None if engine_s is None else engine_s / 3600
    if hours is not None and prices.gpu_hour is not None:
        amounts["engine"] = hours * prices.gpu_hour
    line = {"currency": prices.currency, **{k: round(v, 6) for k, v in amounts.items()},
            "total": round(sum(amounts.values()), 6),
            "cached_share": round(cached / inputs, 4) if inputs else 0.0,
            "per_million": {"input": prices.input, "cached_input": prices.cached_or_input,
                            "output": prices.output}}
    if hours is not None:
        line["engine_hours"] = round(hours, 6)
    if prices.gpu_hour is not None:
        line["gpu_hour"] = prices.gpu_hour
    return line


def describe(cost: dict[str, Any] | None) -> str | None:
    """One line for people: ``12.345678 USD (input 1.2, cached 0.1, output 11.0; 35.0 % cached)``."""
    if not cost:
        return None
    engine = (f", engine {cost['engine']:.6f} for {cost['engine_hours']:.4f} h" if "engine" in cost
              else f"; {cost['engine_hours']:.4f} engine h" if "engine_hours" in cost else "")
    return (f"{cost['total']:.6f} {cost['currency']} (input {cost['input']:.6f}, cached input "
            f"{cost['cached_input']:.6f}, output {cost['output']:.6f}{engine}; "
            f"{cost['cached_share'] * 100:.1f} % of input tokens cached)")
