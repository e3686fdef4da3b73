"""Shared mode's vLLM ``priority`` on every request of a batch.

The deployment's batch priority replaces whatever a line carries: a line's own ``priority``
(0, or lower) would put it before online requests, which is exactly what shared mode exists
to prevent. Every endpoint the pipeline sends to has the field in vLLM's request schema.
"""

from __future__ import annotations

from typing import Any


def prioritized_body(body: dict[str, Any], priority: int | None) -> dict[str, Any]:
    """The body to send (the line's own dict when no priority applies)."""
    if priority is None:
        return body
    return {**body, "priority": priority}
