"""An endpoint's load as its ``/metrics`` page reports it: vLLM's names, or the P/D router's.

Only the handful of series the controller uses are read, by a line scan instead of a full
Prometheus parser: a vLLM page is tens of kilobytes and is read twice a second per endpoint,
and the controller's cost must stay small next to the requests it paces (issue 21: < 5 %).
Sums run over every label set, so a page that serves several models (or a router that
re-exports several instances) reports the endpoint's total.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM v1 names; ``gpu_cache_usage_perc`` is the name before 0.10, still read for older servers.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
TTFT = "vllm:time_to_first_token_seconds"
PREEMPTIONS = "vllm:num_preemptions_total"
# The P/D router's own view (router/admission.py): online requests it holds or has in flight.
ROUTER_ONLINE_WAITING = "aibrix_router_waiting_requests"
ROUTER_INFLIGHT = "aibrix_router_inflight_requests"
# A vLLM server with the online-first middleware (serving/online_first.py) holds requests beyond
# --max-num-seqs itself, so vLLM's own waiting gauge no longer shows them: its count does.
SERVER_ONLINE_WAITING = "aibrix_online_first_waiting_requests"
# The tokens the engine has served (counters): a shard's share of them is its share of the engine's
# time (driver/engine_time.py).
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class MetricsPage:
    """The raw sums of one scrape; ``None`` where the page has no such series."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    preemptions: float | None = None
    router_online_waiting: float | None = None  # the router's, or the online-first server's
    router_inflight: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None

    @property
    def understood(self) -> bool:
        """Whether the page carries any load signal at all (else the endpoint is not vLLM-like)."""
        return self.running is not None or self.waiting is not None or self.router_inflight is not None


@dataclass(frozen=True)
class EndpointSignals:
    """What changed between two scrapes: the controller's input."""

    running: float
    waiting: float
    kv_usage: float | None
    # Mean time to first token of the requests whose first token came between the two scrapes
    # (None: none did). It includes batch requests held back behind online ones, so it errs
    # towards backing off, never towards pushing.
    ttft_s: float | None
    preempted: float
    online_waiting: float | None  # the router's or the online-first server's count, when given


_WANTED = {
    RUNNING: "running", WAITING: "waiting", KV_USAGE[0]: "kv_usage", KV_USAGE[1]: "kv_usage",
    TTFT + "_sum": "ttft_sum", TTFT + "_count": "ttft_count", PREEMPTIONS: "preemptions",
    PROMPT_TOKENS: "prompt_tokens", GENERATION_TOKENS: "generation_tokens",
}


def parse_page(text: str) -> MetricsPage:
    """Sum the wanted series of a Prometheus text page (label sets summed, comments skipped)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or (line[0] != "v" and line[0] != "a"):
            continue
        name_end = _name_end(line)
        name = line[:name_end]
        if name in _WANTED:
            field = _WANTED[name]
        elif name == ROUTER_ONLINE_WAITING or name == ROUTER_INFLIGHT or name == SERVER_ONLINE_WAITING:
            if 'class="online"' not in line:
                continue
            field = "router_inflight" if name == ROUTER_INFLIGHT else "router_online_waiting"
        else:
            continue
        value = _value(line, name_end)
        if value is not None:
            sums[field] = sums.get(field, 0.0) + value
    return MetricsPage(**sums)


def _name_end(line: str) -> int:
    for i, ch in enumerate(line):
        if ch == "{" or ch == " ":
            return i
    return len(line)


def _value(line: str, name_end: int) -> float | None:
    rest = line[name_end:]
    if rest.startswith("{"):
        close = rest.rfind("}")
        if close < 0:
            return None
        rest = rest[close + 1:]
    parts = rest.split()
    if not parts:
        return None
    try:
        return float(parts[0])  # a trailing timestamp, if any, is ignored
    except ValueError:
        return None


def signals_between(before: MetricsPage | None, now: MetricsPage) -> EndpointSignals:
    """The controller's view from two consecutive pages (gauges from ``now``, rates from both)."""
    ttft = None
    preempted = 0.0
    if before is not None:
        if None not in (now.ttft_sum, now.ttft_count, before.ttft_sum, before.ttft_count):
            count = now.ttft_count - before.ttft_count  # type: ignore[operator]
            if count > 0:
                ttft = max(now.ttft_sum - before.ttft_sum, 0.0) / count  # type: ignore[operator]
        if now.preemptions is not None and before.preemptions is not None:
            preempted = max(now.preemptions - before.preemptions, 0.0)
    running = now.running if now.running is not None else (now.router_inflight or 0.0)
    return EndpointSignals(
        running=running, waiting=now.waiting or 0.0, kv_usage=now.kv_usage, ttft_s=ttft,
        preempted=preempted, online_waiting=now.router_online_waiting,
    )
