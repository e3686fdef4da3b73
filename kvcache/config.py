"""Every setting of the connector, in one place.

Settings come from vLLM's ``kv_connector_extra_config`` dict. ``KVCacheSettings.from_extra``
is the only parser; docs/kvcache.md lists the same keys and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

_MODES = ("pipelined", "sync")
_EVICTION = ("s3fifo", "lru")
_L2_BACKENDS = ("none", "fs", "redis")
_L1_CHECKSUMS = ("sampled", "full", "off")


@dataclass(frozen=True)
class KVCacheSettings:
    """Connector settings; field names are the extra_config keys."""

    # "pipelined": layer-wise save behind compute and prefetched loads; "sync": neither.
    mode: str = "pipelined"
    # Tokens per stored chunk; a multiple of vLLM's block size (0 = one block).
    chunk_tokens: int = 0
    # Layers whose loads may be in flight ahead of the layer being computed (0 = all).
    prefetch_window: int = 0
    # Lookahead prefetch (docs/kvcache.md): while the running requests compute, fetch L2 -> L1
    # the chunks of the first N waiting requests, so a request finds its KV in L1 when it is
    # scheduled. 0 = off. (Not ``prefetch_window``: that one counts layers inside one step.)
    lookahead_requests: int = 0
    # Worker threads that move bytes between tiers and the paged KV cache.
    io_threads: int = 2
    # L1: bounded CPU memory pool.
    l1_capacity_bytes: int = 1 << 30
    # "lru" by default: prefix reuse distances are often longer than S3-FIFO's 10%
    # probation queue; "s3fifo" suits scan-heavy mixes of one-off prompts.
    l1_eviction: str = "lru"
    # L2: shared between processes; "none", "fs" or "redis".
    l2_backend: str = "none"
    l2_fs_path: str = ""
    # Seconds an fs-tier call may take (a stuck NFS read) before it counts as a miss; the
    # tier is then skipped for l2_fs_retry_s.
    l2_fs_timeout_s: float = 1.0
    l2_fs_retry_s: float = 1.0
    # No password here: this dict travels on vLLM's command line. The password comes from
    # the environment variable named by l2_redis_password_env, else from the file
    # l2_redis_password_file (a mounted secret).
    l2_redis_url: str = "redis://127.0.0.1:6379/0"
    l2_redis_password_env: str = "KVCACHE_REDIS_PASSWORD"
    l2_redis_password_file: str = ""
    # Seconds a Redis operation may take before the tier is treated as down.
    l2_redis_timeout_s: float = 0.5
    # After a Redis failure, skip Redis for this long (then try again).
    l2_redis_retry_s: float = 1.0
    # Optional keyed MAC on L2 records (codec.Mac): the key comes from the environment
    # variable l2_mac_key_env, else the file l2_mac_key_file, never from this dict. With a
    # key, records without a valid tag are misses. "blake2b" (stdlib) or "blake3".
    l2_mac_key_env: str = "KVCACHE_L2_MAC_KEY"
    l2_mac_key_file: str = ""
    l2_mac_alg: str = "blake2b"
    # L2 writes queued beyond this are dropped (counted), so saves never block compute.
    l2_write_queue_max: int = 4096
    # P/D handoff (kvcache.handoff): a decode request carrying a prefill's kv_transfer_params
    # stays pending until L2 holds the chunks the prefill stored, for at most this long,
    # then loads what is there and recomputes the rest. 0 = never wait.
    handoff_wait_s: float = 5.0
    # While pending, how often the scheduler looks at L2 again (one EXISTS round trip).
    handoff_poll_s: float = 0.005
    # Verify each loaded block's checksum and key before using it.
    verify_checksum: bool = True
    # Integrity of L1 entries (memory of this process; every entry also carries its key):
    # "full" = codec.checksum (xxh3-64) of every byte, ~56-59% of copy bandwidth here;
    # "sampled" = crc32 of one word per 4 KiB (catches reused/overwritten/zeroed slots, not
    # a flipped bit between samples); "off". true/false mean "full"/"off". L2 records
    # always carry a checksum of every byte.
    l1_checksum: str = "full"
    # Expose the prometheus metrics on this port from the worker process (0 = off).
    metrics_port: int = 0
    # Test-only fault injection: while this file exists and says "zeros", loaded
    # payloads are replaced by zeros before verification.
    fault_injection_file: str = ""
    # Extra namespace text, e.g. a model revision, mixed into every key.
    namespace: str = ""
    # The weights' identity in the key namespace. Empty: computed from the model
    # directory's files (kvcache.fingerprint); set it for hub ids without a pinned revision,
    # or to skip reading samples of the weight files at startup.
    model_fingerprint: str = ""

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KVCacheSettings:
        """Parse and validate extra_config; unknown keys are an error (typos fail loudly)."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kvcache settings: {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = known[name].default
            if name == "l1_checksum" and isinstance(value, bool):
                value = "full" if value else "off"
            if isinstance(default, bool):
                values[name] = value if isinstance(value, bool) else str(value).lower() in ("1", "true")
            else:
                values[name] = type(default)(value)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.l1_eviction not in _EVICTION:
            raise ValueError(f"l1_eviction must be one of {_EVICTION}, got {self.l1_eviction!r}")
        if self.l1_checksum not in _L1_CHECKSUMS:
            raise ValueError(f"l1_checksum must be one of {_L1_CHECKSUMS}, got {self.l1_checksum!r}")
        if self.l2_backend not in _L2_BACKENDS:
            raise ValueError(f"l2_backend must be one of {_L2_BACKENDS}, got {self.l2_backend!r}")
        if self.l2_backend == "fs" and not self.l2_fs_path:
            raise ValueError("l2_backend=fs needs l2_fs_path")
        if (self.l1_capacity_bytes < 0 or self.chunk_tokens < 0 or self.prefetch_window < 0
                or self.lookahead_requests < 0):
            raise ValueError("sizes must be >= 0")
        if self.l2_mac_alg not in ("blake2b", "blake3"):
            raise ValueError(f"l2_mac_alg must be blake2b or blake3, got {self.l2_mac_alg!r}")
        if self.handoff_wait_s < 0 or self.handoff_poll_s <= 0:
            raise ValueError("handoff_wait_s must be >= 0 and handoff_poll_s > 0")
        if self.l2_fs_timeout_s <= 0 or self.l2_fs_retry_s < 0:
            raise ValueError("l2_fs_timeout_s must be > 0 and l2_fs_retry_s >= 0")
        if self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")

    @property
    def pipelined(self) -> bool:
        return self.mode == "pipelined"

    def chunk_size(self, block_size: int) -> int:
        """Tokens per chunk, checked against vLLM's block size."""
        chunk = self.chunk_tokens or block_size
        if chunk % block_size:
            raise ValueError(f"chunk_tokens={chunk} is not a multiple of block size {block_size}")
        return chunk
