"""A vLLM API-server middleware that says how the server schedules: ``x-aibrix-scheduling-policy``.

vLLM accepts a request's ``priority`` whatever its ``--scheduling-policy``, and ignores it under
``fcfs``, so a client cannot tell from the answers whether batch requests really yield to
online ones. Shared capacity mode depends on it (docs/shared-capacity.md), so local servers
(serving/local_vllm.py) start vLLM with
``--middleware aibrix_operators.serving.scheduling_policy.report_policy`` (a shared endpoint's
pods need the same) and the driver's preflight reads the header: the value is the running engine's own
configuration (``app.state.vllm_config``), not a flag someone meant to pass.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

HEADER = "x-aibrix-scheduling-policy"
MIDDLEWARE = "aibrix_operators.serving.scheduling_policy.report_policy"


def _policy(app: Any) -> str:
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    policy = getattr(getattr(config, "scheduler_config", None), "policy", None)
    return str(getattr(policy, "value", policy) or "unknown")


async def report_policy(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    response = await call_next(request)
    response.headers[HEADER] = _policy(request.app)
    return response
