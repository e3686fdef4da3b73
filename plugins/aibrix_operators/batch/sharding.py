"""Split a validated batch file into shards for Airflow's dynamic task mapping.

Splitting only cuts at line boundaries (no JSON parsing: validation already
did that), so it runs at disk speed. The shard count never exceeds
``max_shards`` (Airflow's ``[core] max_map_length``): shards grow instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from aibrix_operators.batch.validation import ValidationReport
from aibrix_operators.storage import Storage, join_uri

DEFAULT_SHARD_REQUESTS = 5_000
DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
AIRFLOW_MAX_MAP_LENGTH = 1024


@dataclass(frozen=True)
class ShardSpec:
    """One shard: where its input lies and which lines of the batch file it holds.

    A shard is either the contiguous lines ``first_line .. first_line + num_requests - 1``
    (``lines_uri`` None), or, when split grouped requests by prefix, the lines listed in
    ``lines_uri`` (int64 input line numbers, one per shard line, in shard order; its first
    is ``first_line``): merge reads it to write results back in input order.
    """

    index: int
    uri: str
    first_line: int
    num_requests: int
    num_bytes: int
    lines_uri: str | None = None
    # The LoRA adapter every line of this shard names (docs/lora.md); None: the base model.
    adapter: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardSpec:
        # Fields with defaults may be absent from an XCom written before they existed.
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


@dataclass(frozen=True)
class ShardPlan:
    requests_per_shard: int
    bytes_per_shard: int


def plan_shards(
    total_requests: int,
    total_bytes: int,
    requests_per_shard: int = DEFAULT_SHARD_REQUESTS,
    bytes_per_shard: int = DEFAULT_SHARD_BYTES,
    max_shards: int = AIRFLOW_MAX_MAP_LENGTH,
    max_line_bytes: int = 0,
) -> ShardPlan:
    """Grow the shard size so the shard count stays within ``max_shards``."""
    if requests_per_shard < 1 or bytes_per_shard < 1 or max_shards < 1:
        raise ValueError("requests_per_shard, bytes_per_shard and max_shards must be positive")
    # A shard closes before a line that would overflow it, so leave room for one line
    # (its content plus the newline).
    line_room = max_line_bytes + 1
    requests = max(requests_per_shard, math.ceil(total_requests / max_shards))
    size = max(bytes_per_shard, math.ceil(total_bytes / max_shards) + line_room)
    # Shards closed by the request limit and shards closed by the byte limit add up:
    # at most ceil(N/requests) + ceil(T/(size - line_room)) - 1 shards in all. When both
    # limits bind, give each half of the shard budget so the sum stays <= max_shards.
    if _shard_bound(total_requests, total_bytes, requests, size, line_room) > max_shards:
        by_requests = (max_shards + 2) // 2
        by_bytes = max_shards + 1 - by_requests
        requests = max(requests_per_shard, math.ceil(total_requests / by_requests))
        size = max(bytes_per_shard, math.ceil(total_bytes / by_bytes) + line_room)
    return ShardPlan(requests, size)


def _shard_bound(total_requests: int, total_bytes: int, requests: int, size: int, line_room: int) -> int:
    """An upper bound on the shard count ``split_file`` produces with these limits."""
    if size <= line_room:
        return total_requests  # every line may need its own shard
    return math.ceil(total_requests / requests) + math.ceil(total_bytes / (size - line_room)) - 1


def shard_uri(work_prefix: str, index: int) -> str:
    return join_uri(work_prefix, "shards", f"shard-{index:05d}.jsonl")


def split_file(
    storage: Storage,
    input_uri: str,
    work_prefix: str,
    report: ValidationReport,
    plan: ShardPlan,
) -> list[ShardSpec]:
    """Write the requests of a validated file into shard files under ``work_prefix``."""
    if not report.ok:
        raise ValueError("refusing to split a file that failed validation")
    shards: list[ShardSpec] = []
    # The open shard: its writer's context manager, file, URI, first line, requests, bytes.
    # Plain locals, not a dict: this loop runs once per line of a file of millions.
    cm: Any = None
    write: Any = None
    uri, first, n, b = "", 0, 0, 0
    last_line = report.last_request_line
    max_requests, max_bytes = plan.requests_per_shard, plan.bytes_per_shard
    try:
        with storage.open_read(input_uri) as src:
            for line_no, line in enumerate(src, start=1):
                if line_no > last_line:
                    break  # only trailing blank lines remain
                if not line.endswith(b"\n"):
                    line += b"\n"
                size = len(line)
                if cm is not None and (n >= max_requests or b + size > max_bytes):
                    closing, cm = cm, None
                    closing.__exit__(None, None, None)
                    shards.append(ShardSpec(len(shards), uri, first, n, b))
                if cm is None:
                    uri = shard_uri(work_prefix, len(shards))
                    opening = storage.open_write(uri)
                    write = opening.__enter__().write
                    cm, first, n, b = opening, line_no, 0, 0
                write(line)
                n += 1
                b += size
        if cm is not None:
            closing, cm = cm, None
            closing.__exit__(None, None, None)
            shards.append(ShardSpec(len(shards), uri, first, n, b))
    except BaseException as exc:
        if cm is not None:
            cm.__exit__(type(exc), exc, exc.__traceback__)
        raise
    total = sum(s.num_requests for s in shards)
    if total != report.total_requests:
        raise RuntimeError(
            f"split wrote {total} requests but validation counted {report.total_requests}; "
            f"{input_uri} changed between validation and split"
        )
    return shards
