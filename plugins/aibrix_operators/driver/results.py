"""A shard's durable, append-only result log, stored as segment objects.

Results are buffered in memory and written out as a new segment at least every
``flush_interval_s`` or ``flush_every`` results; each segment appears whole or
not at all (local: temp file + rename; S3: one PUT). Killing the driver loses
at most the unflushed buffer, and a restarted driver reads every segment to
skip the ``custom_id``s already answered. The same layout works on a local
disk and on S3, so a Kubernetes driver pod checkpoints to S3 unchanged.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.storage import Storage, join_uri

SEGMENT_SUFFIX = ".jsonl"


def results_prefix(work_prefix: str, shard_name: str) -> str:
    return join_uri(work_prefix, "results", shard_name)


class ResultLog:
    def __init__(
        self, storage: Storage, prefix: str, flush_interval_s: float = 1.0, flush_every: int = 1000
    ) -> None:
        self.storage = storage
        self.prefix = prefix
        self.flush_interval_s = flush_interval_s
        self.flush_every = flush_every
        # Segment names sort by writer start time, then sequence: a resumed driver's
        # segments sort after the killed one's.
        self._writer = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()

    def segments(self) -> list[str]:
        return [u for u in self.storage.list(self.prefix) if u.endswith(SEGMENT_SUFFIX)]

    def iter_records(self) -> Iterator[tuple[str, bytes]]:
        """Every stored result line as ``(custom_id, line)``, in segment order."""
        for uri in self.segments():
            for line in self.storage.read_bytes(uri).splitlines():
                if line:
                    yield loads(line)["custom_id"], line

    def done_ids(self) -> set[str]:
        return {cid for cid, _ in self.iter_records()}

    def append(self, line: bytes) -> None:
        self._buffer.append(line)

    def due(self) -> bool:
        return bool(self._buffer) and (
            len(self._buffer) >= self.flush_every
            or time.monotonic() - self._last_flush >= self.flush_interval_s
        )

    def take_segment(self) -> tuple[str, bytes] | None:
        """Detach the buffered lines as one segment to write; ``None`` when empty."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return None
        self._seq += 1
        uri = join_uri(self.prefix, f"seg-{self._writer}-{self._seq:06d}{SEGMENT_SUFFIX}")
        data = b"\n".join(self._buffer) + b"\n"
        self._buffer = []
        return uri, data

    def flush(self) -> None:
        segment = self.take_segment()
        if segment is not None:
            self.storage.write_bytes(*segment)
