"""The drivers' progress, read from the shards' result logs, and the work that remains.

Segments are immutable once written and each attempt writes its own in sequence, so each
poll reads only the segments past the last one it read of each attempt (the cursor, one
number per attempt, travels with the sensor's state); a shard's binding (a digest of its
bytes) is computed once. Counts are of result lines: a repeat from an overlapping
attempt counts twice, which only nudges the rate estimate; whether a shard is *done*
is confirmed with the exact ``ResultLog.scan()`` (unique ``custom_id``s) before the
autoscaler may stop.

The requests' sizes: prompt tokens are estimated from a sample of the input (about four
characters per token) until answers arrive, then taken from the answers'
``usage.prompt_tokens``; output tokens are the requests' ``max_tokens`` times the
completion/max ratio seen in the answers (1.0 until there are answers: an upper bound).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aibrix_operators.batch.jsonfast import loads
from aibrix_operators.batch.shard_results import SEGMENT_SUFFIX, ResultLog, fingerprint_shard, results_prefix
from aibrix_operators.batch.sharding import ShardSpec
from aibrix_operators.scaling.policy import RemainingWork
from aibrix_operators.storage import Storage

CHARS_PER_TOKEN = 4.0
DEFAULT_MAX_TOKENS = 1024  # what a request without max_tokens is assumed to allow


@dataclass(frozen=True)
class RequestProfile:
    """Mean size of one request of the batch."""

    prompt_tokens: float
    max_tokens: float


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    if isinstance(value, dict):
        return _text_chars(value.get("content")) + _text_chars(value.get("text"))
    return 0


def profile_requests(lines: Iterable[bytes], default_max_tokens: int = DEFAULT_MAX_TOKENS) -> RequestProfile:
    """Mean prompt tokens (≈ chars / 4) and max output tokens over the given input lines."""
    n = prompt = out = 0.0
    for line in lines:
        if not line.strip():
            continue
        body = loads(line).get("body") or {}
        prompt += _text_chars(body.get("messages")) + _text_chars(body.get("prompt")) + _text_chars(
            body.get("input"))
        embeddings = "input" in body and "messages" not in body and "prompt" not in body
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        out += 0 if embeddings else float(limit if isinstance(limit, int | float) else default_max_tokens)
        n += 1
    if n == 0:
        return RequestProfile(0.0, 0.0)
    return RequestProfile(prompt / n / CHARS_PER_TOKEN, out / n)


def sample_profile(storage: Storage, input_uri: str, sample: int = 2000) -> RequestProfile:
    """Profile the first ``sample`` lines (read in chunks: S3 streams do not iterate by line)."""
    lines: list[bytes] = []
    tail = b""
    with storage.open_read(input_uri) as src:
        while len(lines) < sample and (chunk := src.read(1 << 20)):
            parts = (tail + chunk).split(b"\n")
            tail = parts.pop()
            lines.extend(parts)
    if tail and len(lines) < sample:
        lines.append(tail)
    return profile_requests(lines[:sample])


@dataclass(frozen=True)
class BatchProgress:
    total: int
    answered: int  # result lines seen (may count a repeat twice)
    prompt_tokens: int  # usage sums over the answers seen
    completion_tokens: int
    done: bool  # every shard confirmed complete

    def remaining(self, profile: RequestProfile) -> RemainingWork:
        left = max(self.total - self.answered, 0)
        prompt = self.prompt_tokens / self.answered if self.answered else profile.prompt_tokens
        ratio = 1.0
        if self.answered and profile.max_tokens > 0:
            ratio = min(1.0, self.completion_tokens / (self.answered * profile.max_tokens))
        return RemainingWork(left, left * prompt, left * profile.max_tokens * ratio)


class ProgressTracker:
    """Incremental reader of every shard's result log; ``state()`` resumes it elsewhere."""

    def __init__(self, storage: Storage, work_prefix: str, shards: Iterable[ShardSpec],
                 state: Mapping[str, Any] | None = None) -> None:
        self.storage = storage
        self.work_prefix = work_prefix
        self.shards = list(shards)
        state = state or {}
        saved = state.get("shards") or {}
        self._cursors: dict[str, dict[str, Any]] = {k: dict(v) for k, v in saved.items()}

    def state(self) -> dict[str, Any]:
        return {"shards": self._cursors}

    def poll(self) -> BatchProgress:
        answered = prompt = completion = 0
        all_done = True
        for shard in self.shards:
            cur = self._cursors.setdefault(shard.name, {
                "binding": None, "seen": {}, "lines": 0, "prompt": 0, "completion": 0, "done": False})
            if cur["binding"] is None:
                cur["binding"] = fingerprint_shard(self.storage, shard.uri).binding
            log = ResultLog(self.storage, results_prefix(self.work_prefix, shard.name), cur["binding"])
            if not cur["done"]:
                seen = _last_seq(cur["seen"])
                for uri in log.segments():
                    attempt, seq = _segment_id(uri)
                    if seq <= seen.get(attempt, -1):
                        continue
                    for line in self.storage.read_bytes(uri).splitlines():
                        if not line:
                            continue
                        usage = ((loads(line).get("response") or {}).get("body") or {}).get("usage") or {}
                        cur["lines"] += 1
                        cur["prompt"] += _int(usage.get("prompt_tokens"))
                        cur["completion"] += _int(usage.get("completion_tokens"))
                    seen[attempt] = seq
                cur["seen"] = seen
                if cur["lines"] >= shard.num_requests:
                    cur["done"] = len(log.scan()[0]) >= shard.num_requests
            answered += min(cur["lines"], shard.num_requests)
            prompt += cur["prompt"]
            completion += cur["completion"]
            all_done = all_done and cur["done"]
        total = sum(s.num_requests for s in self.shards)
        return BatchProgress(total, answered, prompt, completion, all_done)


def _segment_id(uri: str) -> tuple[str, int]:
    """``.../seg-<attempt>-<seq>.jsonl`` → (attempt, seq)."""
    name = uri.rsplit("/", 1)[-1].removeprefix("seg-").removesuffix(SEGMENT_SUFFIX)
    attempt, seq = name.rsplit("-", 1)
    return attempt, int(seq)


def _last_seq(seen: Any) -> dict[str, int]:
    """The cursor's read segments: {attempt: last seq read}. Bounded by the attempts, not
    the segments (an attempt writes its segments in order). A list of names (the state of
    a deferral from before this format) is folded into it."""
    if isinstance(seen, dict):
        return {k: int(v) for k, v in seen.items()}
    out: dict[str, int] = {}
    for name in seen or []:
        attempt, seq = _segment_id(name)
        out[attempt] = max(seq, out.get(attempt, -1))
    return out


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0
