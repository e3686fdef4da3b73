"""The vLLM ``priority`` every request of a batch carries: the deployment's, never the line's.

A line's own ``priority`` is a scheduling order among tenants, so it is not the line's to set:
``priority: -2147483648`` on a server run with ``--scheduling-policy priority`` (both Kubernetes
overlays) would put one tenant's batch before every other tenant's, and before online traffic,
and the router's online-first admission would class it as online (never shed). So the driver
replaces it in every mode:

- **shared mode**: the deployment's batch priority (``[aibrix_batch] shared_batch_priority``,
  above the online priority: online requests go first);
- **dedicated mode**: ``DEDICATED_PRIORITY``, vLLM's default 0, the same for every batch (an
  FCFS server accepts only 0; deadline order across batches is Airflow's: scheduling/deadline_order.py).

Every endpoint the pipeline sends to has the field in vLLM's request schema. docs/trust.md
("batch priorities") has the rule and its test.
"""

from __future__ import annotations

from typing import Any

# vLLM's default request priority, and the only one a server without priority scheduling accepts.
DEDICATED_PRIORITY = 0


def prioritized_body(body: dict[str, Any], priority: int) -> dict[str, Any]:
    """The body to send: the line's own dict when it already carries ``priority``, else a copy
    with it (a line's other value, or none, is replaced)."""
    if body.get("priority", None) == priority and type(body["priority"]) is int:
        return body
    return {**body, "priority": priority}
