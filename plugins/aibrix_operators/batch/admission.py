"""Admission with an estimate: will the batch be done in its window at the endpoint's measured rate?

Three things, all kept under the deployment's state root (``[aibrix_batch] state_root``):

* **Rates** (``rates/<key>.json``): per model and endpoint, what finished batches measured: tokens
  (input + output) per second of engine time (their share of the endpoint, ``driver/engine_time.py``;
  their active time when the endpoint does not say), input tokens per byte of batch file, and output
  tokens per request. Merge learns from every batch that answered something (a moving average that
  weighs the newest batch half).
* **The queue** (``queue/<key>/<deadline>-<batch>.json``): the estimated tokens of every admitted
  batch that has not ended, by deadline. Batches are served earliest deadline first, so the work
  ahead of a batch is the queued work with an earlier (or the same) deadline. An entry whose
  deadline has passed no longer counts (its batch has ended, or expired, either way it no longer
  holds the endpoint); merge and record_failure remove their own.
* **The estimate** (``estimate``): this batch's tokens — input tokens from its size at the measured
  tokens per byte, output tokens bounded by its lines' ``max_tokens`` (the measured mean for a line
  without one) — plus the work ahead, at the measured rate. With no measurement yet it says so and
  estimates nothing.

Validate admits a batch with its estimate, or (``[aibrix_batch] admission = refuse``) fails one whose
window cannot be met with ``window_infeasible``, naming the shortest window that would be. ``warn``
(the default) admits it with the estimate saying it is at risk. Core: no Airflow.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from aibrix_operators.storage import Storage, StorageError, delete_object, join_uri

MODES = ("warn", "refuse", "off")
DEFAULT_MODE = "warn"
# The newest batch's weight in a rate's moving average.
LEARN_WEIGHT = 0.5
_OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def output_limit(body: Any) -> int | None:
    """A line's bound on its output tokens (``max_tokens`` or its newer names), or None."""
    if type(body) is not dict:
        return None
    for name in _OUTPUT_LIMITS:
        value = body.get(name)
        if type(value) is int and value >= 0:
            return value
    return None


def endpoint_key(model: str, endpoint: str) -> str:
    """What a rate is measured for: the model on an endpoint (its URL, or ``conn:<id>``)."""
    return f"{model} @ {endpoint}"


def endpoint_label(endpoint: str | None, inference_conn_id: str | None) -> str:
    """The endpoint half of a key, as the DAG's params name it: its URL, else ``conn:<id>``."""
    return endpoint or f"conn:{inference_conn_id}"


def _slug(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:20]


@dataclass
class Rate:
    key: str
    tokens_per_s: float
    input_tokens_per_byte: float
    output_tokens_per_request: float
    batches: int = 1
    updated_at: int = 0

    def learn(self, other: Rate) -> Rate:
        def mix(old: float, new: float) -> float:
            return (1 - LEARN_WEIGHT) * old + LEARN_WEIGHT * new

        return Rate(self.key, mix(self.tokens_per_s, other.tokens_per_s),
                    mix(self.input_tokens_per_byte, other.input_tokens_per_byte),
                    mix(self.output_tokens_per_request, other.output_tokens_per_request),
                    self.batches + 1, other.updated_at)


def measured(key: str, input_tokens: int, output_tokens: int, seconds: float | None, input_bytes: int,
             answered: int, now: int) -> Rate | None:
    """One finished batch's rate; None when it says nothing (no answer, no time)."""
    tokens = input_tokens + output_tokens
    if seconds is None or seconds <= 0 or tokens <= 0 or answered <= 0 or input_bytes <= 0:
        return None
    return Rate(key, tokens / seconds, input_tokens / input_bytes, output_tokens / answered, 1, now)


def rate_uri(state_root: str, key: str) -> str:
    return join_uri(state_root, "rates", f"{_slug(key)}.json")


def read_rate(storage: Storage, state_root: str, key: str) -> Rate | None:
    """The stored rate, or None when there is none (or it is not one); a store that cannot be read
    raises (the estimate then says so, rather than "no measurement")."""
    uri = rate_uri(state_root, key)
    if not storage.exists(uri):
        return None
    try:
        rate = Rate(**json.loads(storage.read_bytes(uri)))
    except (ValueError, TypeError):
        return None
    return rate if rate.key == key and rate.tokens_per_s > 0 else None


def learn_rate(storage: Storage, state_root: str, rate: Rate) -> Rate:
    """Fold a finished batch's rate into the stored one (two merges at once: one sample is lost)."""
    old = read_rate(storage, state_root, rate.key)
    new = old.learn(rate) if old is not None else rate
    storage.write_bytes(rate_uri(state_root, rate.key), json.dumps(asdict(new)).encode())
    return new


def _queue_dir(state_root: str, key: str) -> str:
    return join_uri(state_root, "queue", _slug(key))


def _entry_uri(state_root: str, key: str, deadline: int, batch_id: str) -> str:
    return join_uri(_queue_dir(state_root, key), f"{deadline:010d}-{batch_id}.json")


def enqueue(storage: Storage, state_root: str, key: str, batch_id: str, deadline: int, work: Work) -> None:
    """Queue an admitted batch's work: what validation counted, not tokens, so a batch admitted before
    the endpoint had a measured rate still counts once it has one."""
    entry = {"batch_id": batch_id, "deadline": deadline, "work": asdict(work)}
    storage.write_bytes(_entry_uri(state_root, key, deadline, batch_id), json.dumps(entry).encode())


def dequeue(storage: Storage, state_root: str, key: str, batch_id: str, deadline: int) -> None:
    delete_object(storage, _entry_uri(state_root, key, deadline, batch_id))


def queued_work(
    storage: Storage, state_root: str, key: str, now: float, batch_id: str, rate: Rate
) -> list[tuple[int, int]]:
    """The admitted work on the endpoint, as ``(deadline, tokens at rate)`` by deadline: entries whose
    deadline has not passed, other batches only."""
    work = []
    for uri in storage.list(_queue_dir(state_root, key)):
        name = uri.rsplit("/", 1)[-1]
        due, _, rest = name.partition("-")
        if not due.isdigit() or int(due) <= now or rest == f"{batch_id}.json":
            continue
        try:
            queued = Work(**json.loads(storage.read_bytes(uri))["work"])
        except (StorageError, OSError, ValueError, KeyError, TypeError):
            continue  # ended meanwhile, or not an entry
        work.append((int(due), work_tokens(queued, rate)))
    return sorted(work)


@dataclass(frozen=True)
class Work:
    """What validation counted of a batch: what its estimate rests on."""

    requests: int
    input_bytes: int
    max_output_tokens: int  # the sum of the lines' bounds
    unbounded_requests: int  # lines without one
    # Counted with the model's tokenizer (a dry run, batch/prompt_tokens.py); None: estimated from
    # input_bytes at the measured tokens per byte.
    input_tokens: int | None = None


@dataclass
class Estimate:
    basis: str
    tokens: int | None = None
    input_tokens: int | None = None  # of tokens: counted, or its size at the measured tokens per byte
    output_tokens: int | None = None  # of tokens: the bound (max_tokens, or the measured mean)
    ahead_tokens: int = 0
    tokens_per_s: float | None = None
    seconds: float | None = None
    completion_at: int | None = None
    feasible: bool | None = None
    earliest_window: str | None = None
    # When the batch's own window could be met but it would make an admitted batch with a later
    # deadline miss its own: that batch's deadline.
    would_delay_deadline: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def why_late(self) -> str:
        """Why the window cannot be met, with the figures (for an infeasible estimate)."""
        if self.would_delay_deadline is not None:
            why = (f"ahead of an admitted batch whose window ends at {self.would_delay_deadline} "
                   f"(Unix time), its {self.tokens} tokens would make that batch miss it")
        else:
            why = (f"behind {self.ahead_tokens} tokens of earlier-deadline work, its {self.tokens} tokens "
                   f"would be done {self.seconds:.0f} s from now, after its window ends")
        return (f"at {self.tokens_per_s} tokens/s measured, {why}; the shortest window that would be "
                f"met is {self.earliest_window}")


@dataclass(frozen=True)
class Admission:
    """Where validate judges a batch: the deployment's state, the endpoint (its URL or ``conn:<id>``),
    and what an infeasible window gets (``MODES``)."""

    storage: Storage
    state_root: str
    endpoint: str
    mode: str = DEFAULT_MODE

    def judge(self, model: str, work: Work, batch_id: str, submitted_at: int, deadline: int,
              now: float) -> Estimate:
        """The batch's estimate; one that cannot be made (the state root unreadable) says why and
        admits the batch: an estimate is advice, never a reason to lose a batch."""
        try:
            return self._judge(model, work, batch_id, submitted_at, deadline, now)
        except Exception as exc:  # noqa: BLE001 - a store outage must not fail or refuse a batch
            return Estimate(basis=f"no estimate: the deployment's state could not be read ({exc})"[:500])

    def _judge(self, model: str, work: Work, batch_id: str, submitted_at: int, deadline: int,
               now: float) -> Estimate:
        key = endpoint_key(model, self.endpoint)
        rate = read_rate(self.storage, self.state_root, key)
        queue = [] if rate is None else queued_work(self.storage, self.state_root, key, now, batch_id, rate)
        return estimate(work, rate, queue, now, submitted_at, deadline)

    def admit(self, model: str, batch_id: str, deadline: int, work: Work) -> bool:
        """Queue the admitted batch's work, for the batches judged after it; False when the store
        would not take it (later estimates then miss this batch's work, nothing else)."""
        try:
            key = endpoint_key(model, self.endpoint)
            enqueue(self.storage, self.state_root, key, batch_id, deadline, work)
        except Exception:  # noqa: BLE001 - advice for later batches, never this batch's failure
            return False
        return True


def token_split(work: Work, rate: Rate) -> tuple[int, int]:
    """A batch's (input, output) tokens: as its model's tokenizer counted them, or else its size at the
    measured input tokens per byte; its output bounded by its lines' max_tokens (the measured mean for
    a line without)."""
    counted = work.input_tokens
    return (round(work.input_bytes * rate.input_tokens_per_byte) if counted is None else counted,
            round(work.max_output_tokens + work.unbounded_requests * rate.output_tokens_per_request))


def work_tokens(work: Work, rate: Rate) -> int:
    return sum(token_split(work, rate))


def window_for(seconds: float) -> str:
    """The shortest window, in whole minutes (whole hours when that is exact), of at least ``seconds``."""
    minutes = max(1, math.ceil(seconds / 60))
    return f"{minutes // 60}h" if minutes % 60 == 0 else f"{minutes}m"


def estimate(work: Work, rate: Rate | None, queue: list[tuple[int, int]], now: float, submitted_at: int,
             deadline: int) -> Estimate:
    """When the batch will be done, at ``rate``, behind the queued work with earlier (or equal)
    deadlines; what it rests on. Admitting it must not make a queued batch with a later deadline miss
    its window either (earliest deadline first: this batch would go ahead of it): if it would, the
    estimate is infeasible and the shortest window that would be met is one that ends after that work."""
    ahead_tokens = sum(tokens for due, tokens in queue if due <= deadline)
    if rate is None:
        return Estimate(basis="no measurement yet for this model and endpoint: no estimate until a "
                              "batch has run there", ahead_tokens=ahead_tokens)
    speed = rate.tokens_per_s
    input_tokens, output_tokens = token_split(work, rate)
    tokens = input_tokens + output_tokens
    seconds = (tokens + ahead_tokens) / speed
    done = math.ceil(now + seconds)
    feasible, delayed = done <= deadline, None
    cumulative = tokens + ahead_tokens
    for due, later in ((d, t) for d, t in queue if d > deadline):
        cumulative += later
        if now + cumulative / speed > due >= now + (cumulative - tokens) / speed and feasible:
            feasible, delayed = False, due
    # A window that ends after all the queued work delays nobody.
    window_end = math.ceil(now + cumulative / speed) if delayed is not None else done
    return Estimate(
        basis=(f"{rate.tokens_per_s:.1f} tokens/s measured over {rate.batches} batch(es); output "
               f"bounded by max_tokens ({work.unbounded_requests} line(s) without: "
               f"{rate.output_tokens_per_request:.0f} tokens each, measured)"),
        tokens=tokens, input_tokens=input_tokens, output_tokens=output_tokens, ahead_tokens=ahead_tokens,
        tokens_per_s=round(rate.tokens_per_s, 3),
        seconds=round(seconds, 1), completion_at=done, feasible=feasible,
        earliest_window=None if feasible else window_for(window_end - submitted_at),
        would_delay_deadline=delayed,
    )
