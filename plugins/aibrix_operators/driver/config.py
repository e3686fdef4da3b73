"""Driver settings, with the defaults a user gets when they pass nothing."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


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
    # Name of the environment variable holding the API key; the key itself is never
    # passed around in configs, XComs or pod specs.
    api_key_env: str | None = "OPENAI_API_KEY"
    extra_headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"endpoint {self.endpoint!r} must be an http(s):// base URL of an "
                "OpenAI-compatible server, e.g. http://127.0.0.1:8000"
            )

    @property
    def base_url(self) -> str:
        base = self.endpoint.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **self.extra_headers}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers
