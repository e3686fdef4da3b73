"""Storage tiers: L1 CPU pool and pluggable shared L2 stores."""

from __future__ import annotations

from kvcache.config import KVCacheSettings
from kvcache.secrets import read_secret
from kvcache.tiers.base import L2Store, RecordRefused, TierUnavailable
from kvcache.tiers.fs import FilesystemStore
from kvcache.tiers.l1 import L1Pool
from kvcache.tiers.redis_store import RedisStore

__all__ = [
    "FilesystemStore", "L1Pool", "L2Store", "RecordRefused", "RedisStore", "TierUnavailable", "make_l2",
]


def make_l2(settings: KVCacheSettings) -> L2Store | None:
    """The configured L2 store, or None."""
    if settings.l2_backend == "fs":
        return FilesystemStore(settings.l2_fs_path, settings.l2_fs_timeout_s, settings.l2_fs_retry_s)
    if settings.l2_backend == "redis":
        password = read_secret(settings.l2_redis_password_env, settings.l2_redis_password_file)
        return RedisStore(
            settings.l2_redis_url, settings.l2_redis_timeout_s, settings.l2_redis_retry_s, password
        )
    return None
