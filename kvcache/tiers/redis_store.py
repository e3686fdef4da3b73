"""L2 on Redis. An unreachable Redis is a miss, not an error.

After a failure the store stays "down" for ``retry_s`` and answers every call at once
with TierUnavailable, so an outage costs one timeout, not one per block. The outage and
the recovery are each logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit

import redis

from kvcache.secrets import mask_text, mask_url
from kvcache.tiers.base import RecordRefused, TierUnavailable

# Under "vllm." so that records reach the handlers vLLM configures in its processes.
log = logging.getLogger(f"vllm.{__name__}")


class RedisStore:
    name = "redis"

    def __init__(
        self, url: str, timeout_s: float = 0.5, retry_s: float = 1.0, password: str | None = None
    ) -> None:
        # Only the masked URL is kept: every log line and error names this one.
        self.url = mask_url(url)
        self._secrets = (urlsplit(url).password, password)
        self.retry_s = retry_s
        # A password in the URL wins over ``password`` (redis-py's rule for from_url).
        self._client = redis.Redis.from_url(
            url,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
        )
        if self._secrets[0]:
            log.warning(
                "kvcache: the Redis password is in l2_redis_url, i.e. on vLLM's command line; "
                "set it through l2_redis_password_env or l2_redis_password_file instead"
            )
        log.info("kvcache: Redis L2 at %s", self.url)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.failures = 0

    # -- health ------------------------------------------------------------------------
    def _check(self) -> None:
        if self._down and time.monotonic() < self._down_until:
            raise TierUnavailable("redis marked down")

    def _failed(self, exc: Exception) -> TierUnavailable:
        reason = mask_text(str(exc), *self._secrets)
        with self._lock:
            self.failures += 1
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                log.warning("kvcache: Redis L2 at %s unreachable (%s); treating as misses", self.url, reason)
        return TierUnavailable(reason)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    log.warning("kvcache: Redis L2 at %s reachable again", self.url)

    @property
    def is_down(self) -> bool:
        return self._down

    # -- L2Store -----------------------------------------------------------------------
    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        self._check()
        try:
            if max_bytes is None:
                value = self._client.get(key)
            else:
                # One round trip that never returns more than max_bytes + 1 bytes, however large
                # the value someone stored (GETRANGE is "" for a missing key: no record is empty).
                value = self._client.getrange(key, 0, max_bytes) or None
        except redis.RedisError as exc:
            raise self._failed(exc) from exc
        self._ok()
        if value is not None and max_bytes is not None and len(value) > max_bytes:
            raise RecordRefused(f"{key}: larger than a record of this layout ({max_bytes} bytes)")
        return value

    def put(self, key: str, record: bytes) -> None:
        self._check()
        try:
            self._client.set(key, record)
        except redis.RedisError as exc:
            raise self._failed(exc) from exc
        self._ok()

    def present(self, groups: list[list[str]]) -> list[bool]:
        if not groups:
            return []
        self._check()
        try:
            pipe = self._client.pipeline(transaction=False)
            for group in groups:
                pipe.exists(*group)
            counts = pipe.execute()
        except redis.RedisError as exc:
            raise self._failed(exc) from exc
        self._ok()
        return [count == len(group) for group, count in zip(groups, counts, strict=True)]

    def close(self) -> None:
        self._client.close()
