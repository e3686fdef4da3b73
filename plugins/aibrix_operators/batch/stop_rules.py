"""Stop rules: a batch that fails on its own, or runs past its budget, stops early.

Two rules, each off unless the batch asks for it (``docs/stop-rules.md``):

* ``max_error_rate``: once at least ``error_rate_min_sample`` of the batch's requests are answered,
  the share that ended with an error of their *own* (a 4xx, a 5xx that kept coming while the endpoint
  answered others: ARCHITECTURE.md §5) may not exceed it. An outage never counts: the driver pauses
  through it and writes no error line, and lines a cancel, a stop or the window's end left unanswered
  are not the requests' errors either.
* ``max_total_tokens``: the batch's input plus output tokens, as the server counted them.

The batch is judged as a whole: each shard's driver publishes its tally under the run's work prefix
(``tally_uri``) and sums the others'. The first driver that finds a rule tripped writes the stop
marker (``stop_marker_uri``) with the rule and its figures; every driver stops sending at it as at a
cancel, the unanswered requests end as ``batch_stopped`` lines, and merge publishes the batch
``failed`` with the rule's code, its answers so far in the output.

Core: no Airflow and no driver; validate checks the rules once, the driver and merge read them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from aibrix_operators.batch.error_codes import BatchFailure
from aibrix_operators.storage import join_uri

# Fewer answers than this say little about a batch's error rate (a bad first few lines of a
# large file must not stop it); a batch may ask for a smaller or larger sample.
DEFAULT_MIN_SAMPLE = 100


@dataclass(frozen=True)
class StopRules:
    """A batch's stop rules; ``None`` turns a rule off. ValueError (naming the rule and how to fix
    it) for a value out of range."""

    max_error_rate: float | None = None
    error_rate_min_sample: int = DEFAULT_MIN_SAMPLE
    max_total_tokens: int | None = None

    def __post_init__(self) -> None:
        rate = self.max_error_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                                 or not math.isfinite(rate) or not 0 < rate <= 1):
            raise ValueError(f"max_error_rate must be a fraction in (0, 1], e.g. 0.2 for 20 %, "
                             f"or null to turn it off; got {rate!r}")
        sample = self.error_rate_min_sample
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise ValueError(f"error_rate_min_sample must be a whole number >= 1; got {sample!r}")
        budget = self.max_total_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"max_total_tokens must be a whole number of tokens >= 1, or null to turn "
                             f"it off; got {budget!r}")

    @property
    def active(self) -> bool:
        return self.max_error_rate is not None or self.max_total_tokens is not None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StopRules:
        """The rules from a mapping (a DAG run's params, the API's ``stop_rules``, XCom, a pod's
        config); missing keys keep their defaults, unknown ones are refused."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"stop rules must be an object like {{\"max_error_rate\": 0.2}}; got {data!r}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ValueError(f"unknown stop rule(s) {unknown}: the rules are {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if v is not None or k != "error_rate_min_sample"})

    def within(self, max_tokens_limit: int | None) -> StopRules:
        """These rules under the deployment's ``max_batch_tokens`` (None: no limit): a batch without a
        budget gets the limit as its budget; one that asks for more is refused (ValueError)."""
        if max_tokens_limit is None:
            return self
        if self.max_total_tokens is None:
            return StopRules(self.max_error_rate, self.error_rate_min_sample, max_tokens_limit)
        if self.max_total_tokens > max_tokens_limit:
            raise ValueError(f"max_total_tokens {self.max_total_tokens} is over this deployment's limit of "
                             f"{max_tokens_limit} ([aibrix_batch] max_batch_tokens); ask for at most that")
        return self

    def verdict(self, tally: StopTally) -> StopReason | None:
        """The first rule the batch's tally trips, or None."""
        if self.max_total_tokens is not None and tally.tokens >= self.max_total_tokens:
            return StopReason(
                "max_total_tokens", BatchFailure.MAX_TOTAL_TOKENS_EXCEEDED,
                f"the batch used {tally.tokens} tokens ({tally.input_tokens} input + {tally.output_tokens} "
                f"output), reaching its max_total_tokens budget of {self.max_total_tokens}; it stopped "
                f"sending after {tally.answered} answers", tally.as_dict())
        if (self.max_error_rate is not None and tally.answered >= self.error_rate_min_sample
                and tally.own_errors > self.max_error_rate * tally.answered):
            return StopReason(
                "max_error_rate", BatchFailure.MAX_ERROR_RATE_EXCEEDED,
                f"{tally.own_errors} of the batch's first {tally.answered} answers were errors of the "
                f"requests' own ({tally.own_errors / tally.answered:.1%}), over its max_error_rate of "
                f"{self.max_error_rate:.1%}; it stopped sending (see the error file for what the "
                "server said)", tally.as_dict())
        return None


@dataclass
class StopTally:
    """What a shard (or the batch, summed) has answered, as the rules count it."""

    answered: int = 0
    own_errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def add(self, other: StopTally) -> None:
        self.answered += other.answered
        self.own_errors += other.own_errors
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StopTally:
        """A published tally; anything unreadable counts as nothing (a half-written object from
        an older driver must not stop or fail a batch)."""
        if not isinstance(data, dict):
            return cls()
        values = {f.name: data.get(f.name) for f in fields(cls)}
        return cls(**{k: v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0
                      for k, v in values.items()})


@dataclass(frozen=True)
class StopReason:
    """A tripped rule: its name, the batch's error code, the message a user reads, the figures."""

    rule: str
    code: str
    message: str
    figures: dict[str, int]

    def to_bytes(self) -> bytes:
        return json.dumps({"rule": self.rule, "code": str(self.code), "message": self.message,
                           "figures": self.figures}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> StopReason:
        """The stop marker's content; one that cannot be read still stops the batch, named so."""
        try:
            data = json.loads(raw)
            code = BatchFailure(data["code"])
            return cls(str(data["rule"]), code, str(data["message"]), dict(data.get("figures") or {}))
        except (ValueError, KeyError, TypeError):
            return cls("unknown", BatchFailure.MAX_ERROR_RATE_EXCEEDED,
                       "a stop rule stopped the batch; its marker could not be read", {})


def stop_prefix(work: str) -> str:
    """Where a run's drivers publish their tallies and the stop marker."""
    return join_uri(work, "stop")


MARKER_NAME = "STOP"


def marker_uri(prefix: str) -> str:
    """The object under ``stop_prefix`` whose existence stops every driver of the run (its content:
    a ``StopReason``)."""
    return join_uri(prefix, MARKER_NAME)


def stop_marker_uri(work: str) -> str:
    """The run's stop marker, from its work prefix."""
    return marker_uri(stop_prefix(work))


def tally_uri(prefix: str, shard_name: str) -> str:
    """A shard's published tally under ``stop_prefix``."""
    return join_uri(prefix, f"{shard_name}.json")
