"""The shared-mode control law: how many batch requests an endpoint may hold, tick by tick.

Pure functions of what the controller saw (no I/O, no clock), so every rule is tested alone.
Batch takes the endpoint's *idle* capacity: at most ``target_inflight`` minus the online
requests the endpoint is serving (the deployment says what the endpoint holds at a good
latency), and less whenever the endpoint says it is full. The order of the rules is the order
of trust in the signals:

1. 429/503 answers to batch requests: the endpoint (or the router shedding batch first) says
   so itself: halve.
2. Online traffic alone fills the endpoint (``target_inflight`` or more online requests, or the
   router queues online ones): straight to the floor; the batch keeps out of a burst entirely.
3. Only batch requests queued at the server beyond the allowed queue: shrink to what it runs.
4. KV cache nearly full (preemptions next) or TTFT over the deployment's target: cut by 30 %.
5. Otherwise grow: straight to the allowance on an idle endpoint (an idle phase is filled at
   once), by ``urgency`` per tick beside online traffic.

The allowance is the headroom plus ``batch_queue`` requests that may wait at the server (with
priority scheduling they wait behind every online request, and keep the slots busy between a
batch answer and the driver's next request). The limit never exceeds ``max_limit`` (the
trigger's ``concurrency``) nor the allowance, and never falls below ``min_limit`` (0 in shared
mode: a burst may take the whole endpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aibrix_operators.capacity.signals import EndpointSignals


@dataclass(frozen=True)
class ControlLimits:
    max_limit: int  # the trigger's concurrency: never more in flight than dedicated mode sends
    target_inflight: int  # requests (online + batch) the endpoint holds at a good latency
    min_limit: int = 0
    max_waiting: int = 0  # requests queued at the server before it counts as full
    batch_queue: int = 4  # batch requests that may wait at the server beyond the headroom
    max_kv_usage: float = 0.95
    ttft_target_s: float | None = None


@dataclass(frozen=True)
class Decision:
    limit: int
    reason: str  # why the limit is what it is (a label of the back-off/growth metric)
    online: float  # online requests the endpoint serves, as estimated this tick


# Reasons, as they appear in metrics and the progress line.
BACKPRESSURE = "backpressure"
ONLINE_WAITING = "online_waiting"
SERVER_FULL = "server_full"
KV_CACHE = "kv_cache"
TTFT = "ttft"
ONLINE_SHARE = "online_share"
GROW_IDLE = "grow_idle"
GROW_SHARED = "grow_shared"
AT_MAX = "at_max"
NO_SIGNALS = "no_signals"


def online_load(signals: EndpointSignals, ours_in_flight: int) -> float:
    """Online requests at the endpoint: the router counts them itself; for vLLM, everything it
    runs or queues that is not ours."""
    if signals.online_waiting is not None:
        return max(signals.running - ours_in_flight, 0.0) + signals.online_waiting
    return max(signals.running + signals.waiting - ours_in_flight, 0.0)


def decide(
    limit: int, limits: ControlLimits, signals: EndpointSignals | None, ours_in_flight: int,
    backpressure: int, urgency: float = 1.0,
) -> Decision:
    """The next limit, from this tick's signals and the 429/503 answers counted since the last."""
    floor_ = limits.min_limit
    if signals is None:
        # No load page (a scrape failed): keep sending, but only as much as the answers allow,
        # and never from an empty limit (nothing would tell us to start again).
        # Plain AIMD on the answers then: halve on 429/503, one more per quiet tick, at most the
        # target (the deployment's word for what the endpoint holds).
        floor_ = max(floor_, 1)
        if backpressure:
            return Decision(max(floor_, limit // 2), BACKPRESSURE, 0.0)
        ceiling = max(floor_, min(limits.max_limit, limits.target_inflight))
        return Decision(max(floor_, min(limit + 1, ceiling)), NO_SIGNALS, 0.0)
    online = online_load(signals, ours_in_flight)
    # Online traffic alone fills the endpoint (a burst): batch keeps out entirely, even out of
    # the server's queue, where it would take a slot in the gap between two online requests.
    saturated = online >= limits.target_inflight or (signals.online_waiting or 0) > limits.max_waiting
    headroom = max(0, limits.target_inflight - math.ceil(online))
    # Below saturation a few batch requests may wait at the server beyond the headroom: with
    # priority scheduling they queue behind every online request, and a slot freed by a batch
    # request is refilled at once instead of after a round trip to the driver.
    allowance = max(floor_, min(limits.max_limit, headroom + (0 if saturated else limits.batch_queue)))
    if backpressure:
        return Decision(max(floor_, min(limit // 2, allowance)), BACKPRESSURE, online)
    if saturated:
        queued = signals.waiting > limits.max_waiting or (signals.online_waiting or 0) > limits.max_waiting
        return Decision(floor_, ONLINE_WAITING if queued else ONLINE_SHARE, online)
    if online == 0 and signals.waiting > limits.max_waiting + limits.batch_queue:
        # Only batch requests, and more of them queued than allowed: the server runs fewer than
        # the target says; shrink to what it runs plus the queue.
        runs = ours_in_flight - math.ceil(signals.waiting) + limits.batch_queue
        return Decision(max(floor_, min(limit, runs, allowance)), SERVER_FULL, online)
    if signals.kv_usage is not None and signals.kv_usage > limits.max_kv_usage:
        return Decision(max(floor_, min(int(limit * 0.7), allowance)), KV_CACHE, online)
    target = limits.ttft_target_s
    if target is not None and signals.ttft_s is not None and signals.ttft_s > target:
        return Decision(max(floor_, min(int(limit * 0.7), allowance)), TTFT, online)
    if online > 0:
        grown, reason = limit + max(1, round(urgency)), GROW_SHARED
    else:
        # Idle: straight to what the endpoint can take (the deployment's target says what that
        # is; the rules above pull it back within a tick if the server disagrees).
        grown, reason = allowance, GROW_IDLE
    if grown >= allowance:
        reason = AT_MAX if allowance >= limits.max_limit else (GROW_IDLE if online == 0 else ONLINE_SHARE)
    return Decision(max(floor_, min(grown, allowance)), reason, online)
