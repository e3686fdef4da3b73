"""A shard's durable, append-only result log, stored as segment objects.

Results are buffered in memory and written out as a new segment at least every
``flush_interval_s`` or ``flush_every`` results; each segment appears whole or
not at all (local: temp file + rename; S3: one PUT). Killing the driver loses
at most the unflushed buffer, and a restarted driver reads every segment to
skip the ``custom_id``s already answered. The same layout works on a local
disk and on S3, so a Kubernetes driver pod checkpoints to S3 unchanged.

Layout: ``<results prefix>/<binding>/seg-<attempt>-<seq>.jsonl``.

- ``binding`` is a digest of the shard's bytes: a shard re-split from an edited
  input gets a new binding, so answers to the old requests are never reused.
  (Re-validating an *unchanged* file keeps its answers: they answer the same
  requests.)
- ``attempt`` is unique per driver run and sorts by start time: two attempts that
  overlap (a zombie worker, an orphaned pod) write distinct segments, and merge
  keeps the first answer per ``custom_id`` in segment order.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.records import Usage
from aibrix_operators.storage import Storage, join_uri

SEGMENT_SUFFIX = ".jsonl"
_DIGEST_CHUNK = 1 << 20


def results_prefix(work_prefix: str, shard_name: str) -> str:
    return join_uri(work_prefix, "results", shard_name)


@dataclass(frozen=True)
class ShardFingerprint:
    """What a shard's results are bound to: its bytes' digest, and its request count."""

    binding: str
    requests: int


def fingerprint_shard(storage: Storage, shard_uri: str) -> ShardFingerprint:
    """One streaming pass over the shard: its content digest and non-blank line count."""
    digest = hashlib.blake2b(digest_size=12)
    requests = 0
    tail = b""
    with storage.open_read(shard_uri) as src:
        while chunk := src.read(_DIGEST_CHUNK):
            digest.update(chunk)
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            requests += sum(1 for line in lines if line.strip())
    if tail.strip():
        requests += 1
    return ShardFingerprint(digest.hexdigest(), requests)


def shard_result_log(storage: Storage, prefix: str, shard_uri: str) -> ResultLog:
    """The result log bound to the shard's current content (what merge and tests read)."""
    return ResultLog(storage, prefix, fingerprint_shard(storage, shard_uri).binding)


def new_attempt_id() -> str:
    # Start time first, so a later attempt's segments sort after an earlier one's.
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


class ResultLog:
    def __init__(
        self,
        storage: Storage,
        prefix: str,
        binding: str,
        flush_interval_s: float = 1.0,
        flush_every: int = 1000,
        attempt_id: str | None = None,
    ) -> None:
        self.storage = storage
        self.prefix = join_uri(prefix, binding)
        self.flush_interval_s = flush_interval_s
        self.flush_every = flush_every
        self.attempt_id = attempt_id or new_attempt_id()
        self._seq = 0
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()

    def segments(self, after: str | None = None) -> list[str]:
        """This binding's segments, oldest attempt first (the order merge reads them in);
        with ``after`` (one of them), only those that sort after it."""
        listed = self.storage.list(self.prefix) if after is None else self.storage.list(self.prefix, after)
        found = [u for u in listed if u.endswith(SEGMENT_SUFFIX)]
        return sorted(found, key=lambda u: u.rsplit("/", 1)[-1])

    def _stored(self) -> Iterator[tuple[dict, bytes]]:
        """Every stored result as ``(record, line)``, in segment order."""
        for uri in self.segments():
            for line in self.storage.read_bytes(uri).splitlines():
                if line:
                    yield loads(line), line

    def iter_records(self) -> Iterator[tuple[str, bytes]]:
        """Every stored result line as ``(custom_id, line)``, in segment order."""
        for record, line in self._stored():
            yield record["custom_id"], line

    def done_ids(self) -> set[str]:
        return self.scan()[0]

    def scan(self) -> tuple[set[str], int]:
        """The answered ``custom_id``s, and how many of those answers are error lines."""
        tally = ResultTally(self)
        tally.update()
        return tally.done, tally.errors

    def append(self, line: bytes) -> None:
        self._buffer.append(line)

    def buffered(self) -> int:
        return len(self._buffer)

    def due(self) -> bool:
        return bool(self._buffer) and (
            len(self._buffer) >= self.flush_every
            or time.monotonic() - self._last_flush >= self.flush_interval_s
        )

    def take_segment(self) -> tuple[str, bytes] | None:
        """Detach the buffered lines as one segment to write; ``None`` when empty.

        The caller owns the bytes until its write succeeds (see ``CheckpointWriter``).
        """
        self._last_flush = time.monotonic()
        if not self._buffer:
            return None
        self._seq += 1
        uri = join_uri(self.prefix, f"seg-{self.attempt_id}-{self._seq:06d}{SEGMENT_SUFFIX}")
        data = b"\n".join(self._buffer) + b"\n"
        self._buffer = []
        return uri, data

    def flush(self) -> None:
        segment = self.take_segment()
        if segment is not None:
            self.storage.write_bytes(*segment)


class ResultTally:
    """A result log's answered ``custom_id``s and error count, reading each segment once.

    A segment is written whole and never changes, so a caller that polls a running
    shard (the Batch API's live ``request_counts``) reads only the segments that
    appeared since its last ``update``, found by a listing that starts after the last
    one counted (S3's ``StartAfter``): a poll costs what is new, not a listing and a read
    of every result so far. Counting is the same as merge's (the first answer per
    ``custom_id`` in segment order decides whether it is an error). Two things only a
    whole listing shows: a segment that sorts before one already counted (an overlapping
    older attempt) and a counted one that is gone (the log was cleared). One is taken at
    least every ``full_listing_s``, and on either the tally starts over, so the live
    counts are right again within that time. Polls of one batch may come on several
    api-server threads at once: ``update`` takes them in turn.
    """

    def __init__(self, log: ResultLog, full_listing_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.full_listing_s = full_listing_s
        self.done: set[str] = set()
        self.errors = 0
        self.usage = Usage()  # the answers' tokens, as merge will total them (the batch's live usage)
        self.segments_read = 0  # segment reads over this tally's life (what a poll costs)
        self._counted: list[str] = []  # segment names, in the order they were counted
        self._last_uri: str | None = None
        self._clock = clock
        self._full_listing_at: float | None = None
        self._lock = threading.Lock()

    def update(self) -> tuple[int, int]:
        """Count the segments not counted yet; returns ``(answered, errors)``."""
        with self._lock:
            now = self._clock()
            if self._full_listing_at is None or now - self._full_listing_at >= self.full_listing_s:
                self._full_listing_at = now
                self._count(self._new_in_full_listing())
            else:
                self._count(self.log.segments(after=self._last_uri))
            return len(self.done), self.errors

    def _new_in_full_listing(self) -> list[str]:
        listed = self.log.segments()
        counted = set(self._counted)
        new = [uri for uri in listed if _name(uri) not in counted]
        if len(listed) - len(new) != len(self._counted) or (
                new and self._counted and _name(new[0]) < self._counted[-1]):
            self.done, self.errors, self._counted, self._last_uri = set(), 0, [], None
            self.usage = Usage()
            return listed
        return new

    def _count(self, uris: list[str]) -> None:
        for uri in uris:
            self.segments_read += 1
            for line in self.log.storage.read_bytes(uri).splitlines():
                if not line:
                    continue
                record = loads(line)
                if record["custom_id"] not in self.done:
                    self.done.add(record["custom_id"])
                    if record.get("error") is not None:
                        self.errors += 1
                    else:
                        self.usage.add_response_body((record.get("response") or {}).get("body"))
            self._counted.append(_name(uri))
            self._last_uri = uri


def _name(uri: str) -> str:
    return uri.rsplit("/", 1)[-1]
