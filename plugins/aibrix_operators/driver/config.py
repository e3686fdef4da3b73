"""Driver settings, with the defaults a user gets when they pass nothing."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from aibrix_operators.batch.stop_rules import StopRules
from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.cache_salt import check_cache_salt
from aibrix_operators.trust.policy import endpoint_form_problem, under_base

# How long a shard's preflight waits for a starting or restarting endpoint (driver/preflight.py):
# the operator's, the DAG param's, the pod's and the CLI's default.
DEFAULT_ENDPOINT_WAIT_S = 300.0


# Never in a pod's config: the key comes from the pod's environment (``api_key_env``, a Secret),
# and extra headers are the worker's alone.
_NOT_SENT = ("api_key", "api_key_origin", "extra_headers")


def default(name: str) -> Any:
    """A ``DriverConfig`` field's default: where every per-shard setting's default lives (the DAG's
    params, the operator's signature, the pod request and the driver CLI read it here)."""
    return DriverConfig.__dataclass_fields__[name].default


@dataclass(frozen=True)
class DriverConfig:
    # Base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000; the
    # request's own url (/v1/chat/completions) is appended. A trailing /v1 is tolerated.
    endpoint: str
    concurrency: int = 64
    max_attempts: int = 5
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    # Checkpoint: results are made durable at least this often (the loss window on a kill).
    flush_interval_s: float = 1.0
    flush_every: int = 1000
    progress_interval_s: float = 10.0
    # Unix time after which no new request is started (OpenAI's completion window).
    deadline: float | None = None
    # Name of the environment variable holding the API key (driver pods get it from a
    # Secret); the Airflow worker passes None and uses ``api_key`` from a connection.
    api_key_env: str | None = "OPENAI_API_KEY"
    extra_headers: dict[str, str] = field(default_factory=dict, repr=False)
    # The API key, from an Airflow connection; repr=False keeps it out of logs and tracebacks.
    api_key: str | None = field(default=None, repr=False)
    # The base URL the key belongs to (an origin scheme://host:port, or one with a path): it
    # is sent only when ``endpoint`` is that URL or below its path, so a trigger that names
    # another endpoint never receives it. For the env key, None means "${api_key_env}_ORIGIN"
    # (e.g. OPENAI_API_KEY_ORIGIN).
    api_key_origin: str | None = None
    # Outage handling (driver/health.py): this many infrastructure failures in a row pause
    # every request while the endpoint is probed every probe_interval_s; no answer for
    # outage_budget_s fails the shard without recording the unanswered requests.
    breaker_failures: int = 5
    probe_interval_s: float = 2.0
    outage_budget_s: float = 900.0
    # Checkpoint durability (driver/checkpoint.py): a failing store is retried this long,
    # and workers pause once this many answers wait in memory for it.
    checkpoint_retry_s: float = 120.0
    max_unflushed: int = 20_000
    # Cancel (driver/cancel.py): when an object exists at cancel_uri, no new request or attempt
    # starts; unanswered requests end as batch_cancelled. Polled every cancel_poll_s.
    cancel_uri: str | None = None
    # vLLM cache_salt put on every generation request (driver/cache_salt.py): the Batch API
    # sets one per tenant. None: the lines' own, if any.
    cache_salt: str | None = None
    cancel_poll_s: float = 1.0
    # Shared capacity mode (capacity/): the endpoint also serves online traffic, so requests carry
    # the deployment's batch priority and an adaptive limit per endpoint paces them (at most
    # ``concurrency``). None: dedicated, ``concurrency`` requests in flight throughout.
    capacity: SharedCapacity | None = None
    # Stop rules (batch/stop_rules.py, driver/stop_watch.py): the batch's, checked by validate. The
    # shard publishes its tally under stop_prefix and sums the others' every stop_poll_s; a tripped
    # rule stops the batch like a cancel. None: no rule, nothing published.
    stop_rules: StopRules | None = None
    stop_prefix: str | None = None
    stop_poll_s: float = 5.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("breaker_failures", "max_unflushed", "flush_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("probe_interval_s", "outage_budget_s", "checkpoint_retry_s", "flush_interval_s",
                     "request_timeout_s", "connect_timeout_s", "cancel_poll_s", "stop_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        check_cache_salt(self.cache_salt)
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"endpoint {self.endpoint!r} must be an http(s):// base URL of an "
                "OpenAI-compatible server, e.g. http://127.0.0.1:8000"
            )
        if problem := endpoint_form_problem(self.endpoint):
            raise ValueError(f"endpoint {self.endpoint!r}: {problem}")

    def for_pod(self) -> DriverConfig:
        """This config as a driver pod runs it: the key from the pod's environment (the
        deployment's inference Secret, ``api_key_env``), never the worker's connection password."""
        return replace(self, api_key=None, api_key_origin=None, extra_headers={},
                       api_key_env=self.api_key_env or default("api_key_env"))

    def to_json(self) -> str:
        """The one serialisation a driver pod receives (``--config-json``; ``from_json`` reads it
        back and checks it as the worker's config was checked). No key or extra header travels."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SENT}
        data["capacity"] = asdict(self.capacity) if self.capacity is not None else None
        data["stop_rules"] = self.stop_rules.as_dict() if self.stop_rules is not None else None
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> DriverConfig:
        """``to_json``'s output back as a config: every field known, the values checked
        (``__post_init__``); anything else is a ValueError that names it."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"driver config is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("driver config must be a JSON object")
        known = {f.name for f in fields(cls)} - set(_NOT_SENT)
        if unknown := sorted(set(data) - known):
            raise ValueError(f"driver config has unknown fields {unknown}: the pod's driver is older or "
                             "newer than the worker's (use the same image version)")
        if "endpoint" not in data:
            raise ValueError("driver config has no endpoint")
        capacity = data.pop("capacity", None)
        rules = data.pop("stop_rules", None)
        try:
            return cls(**data, capacity=SharedCapacity(**capacity) if capacity is not None else None,
                       stop_rules=StopRules.from_dict(rules) if rules is not None else None)
        except TypeError as exc:
            raise ValueError(f"driver config: {exc}") from exc

    @property
    def base_url(self) -> str:
        base = self.endpoint.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    def headers(self) -> dict[str, str]:
        """Request headers; ``Authorization`` only toward the key's own origin (trust.py)."""
        headers = {"Content-Type": "application/json", **self.extra_headers}
        key, bound_to = self.api_key, self.api_key_origin
        if not key and self.api_key_env:
            key = os.environ.get(self.api_key_env)
            bound_to = bound_to or os.environ.get(f"{self.api_key_env}_ORIGIN")
        if key and bound_to and under_base(self.endpoint, bound_to):
            headers["Authorization"] = f"Bearer {key}"
        return headers
