"""A shared L2 that others can write to, end to end: one real vLLM CPU server, real Redis.

The server keeps no L1 (``l1_capacity_bytes: 0``), so every hit is a Redis read, and has
vLLM's prefix caching on (emptied through ``/reset_prefix_cache`` before each request, so
the connector serves what is cached). Its own first answer to a prompt, computed with an
empty Redis, is the baseline: a full prefill. Redis needs a password (read from a file)
and records carry a MAC (key from the environment), as a deployment sharing Redis
between tenants would run it.
"""

from __future__ import annotations

import json
import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import xxhash
from kvcache_testlib import RedisServer, assert_same, random_prompt, scrape

from kvcache import codec
from kvcache.launch import LocalServer, cached_tokens, free_port, kv_transfer_config

pytestmark = pytest.mark.service

BLOCK = 128
LAYERS = 4
_HEAD = struct.Struct("<4sI")


@dataclass
class Shared:
    server: LocalServer
    redis: RedisServer
    metrics_port: int

    def fresh(self, prompt: list[int], max_tokens: int = 8, salt: str | None = None) -> dict[str, Any]:
        self.server.reset_prefix_cache()
        extra = {"cache_salt": salt} if salt is not None else None
        return self.server.complete(prompt, max_tokens=max_tokens, extra=extra)

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def client(self) -> redis.Redis:
        return self.redis.client()


# Redis requires this password; the server reads it from a file (a mounted secret), and it
# must appear in no log line and no command line.
PLANTED_PASSWORD = "planted-Pa55word-7f3c9"
# Records are authenticated with this key (from the server's environment).
MAC_KEY = "test-mac-key-5b1e"
MAC = codec.Mac(MAC_KEY.encode(), "blake2b")


@pytest.fixture(scope="module")
def shared(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    redis_srv = RedisServer(password=PLANTED_PASSWORD).start()
    secret = tmp_path_factory.mktemp("secrets") / "redis-password"
    secret.write_text(PLANTED_PASSWORD + "\n")
    port = free_port()
    extra = {
        "l1_capacity_bytes": 0,
        "l2_backend": "redis",
        "l2_redis_url": redis_srv.url,
        "l2_redis_password_file": str(secret),
        "l2_redis_timeout_s": 2.0,
        "l2_redis_retry_s": 0.5,
        "metrics_port": port,
    }
    server = LocalServer(
        tiny_model, kv_config=kv_transfer_config(extra), prefix_caching=True, dev_mode=True,
        compact_engine=True,
    )
    server.env.pop("KVCACHE_REDIS_PASSWORD", None)
    server.env["KVCACHE_L2_MAC_KEY"] = MAC_KEY
    try:
        with server:
            yield Shared(server, redis_srv, port)
    finally:
        redis_srv.stop()


def _wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _parse(record: bytes) -> tuple[dict[str, Any], bytes]:
    n = _HEAD.unpack_from(record)[1]
    return json.loads(record[_HEAD.size : _HEAD.size + n]), record[_HEAD.size + n :]


def _pack(header: object, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return _HEAD.pack(b"KVC1", len(raw)) + raw + payload


def _fuzz(kind: str, record: bytes, other: bytes, rng: random.Random) -> bytes:
    """A malformed record of the given kind, made from the valid (tagged) ``record`` of that
    key. Malformed content is tagged with the right MAC key, as a buggy writer holding the
    key would, so that the parser behind the MAC check is what gets exercised."""
    if kind == "flipped-byte":  # damage at rest: the tag no longer matches
        body = bytearray(record)
        body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        return bytes(body)
    if kind == "other-key":  # a valid record of another chunk / layer
        return other
    header, payload = _parse(record[: -codec.TAG_BYTES])
    payload = payload[: header["nbytes"]]
    if kind == "random":
        bad = rng.randbytes(rng.choice((0, 3, 8, 100, len(record))))
    elif kind == "truncated":
        bad = record[: rng.randrange(0, len(record) - codec.TAG_BYTES)]
    elif kind == "header-not-object":
        bad = _pack(rng.choice(([1, 2], "x", None, 3.5)), payload)
    elif kind == "header-bad-fields":
        field, value = rng.choice(
            (("sum", "abc"), ("sum", None), ("sum", 2.5), ("sum_alg", "md5"), ("nbytes", "x"),
             ("shape", "1,2"), ("shape", [None]), ("dtype", 7), ("key", 1), ("mac", None))
        )  # fmt: skip
        bad = _pack({**header, field: value}, payload)
    elif kind == "short-payload":  # the header's nbytes and checksum agree with it
        cut = payload[: len(payload) // 2]
        bad = _pack({**header, "nbytes": len(cut), "sum": xxhash.xxh3_64_intdigest(cut)}, cut)
    elif kind == "wrong-shape":  # a consistent record of another shape, under this key
        half = payload[: len(payload) // 2]
        shape = [2, len(half) // 8]
        bad = _pack(
            {**header, "shape": shape, "nbytes": len(half), "sum": xxhash.xxh3_64_intdigest(half)}, half
        )
    else:
        raise ValueError(kind)
    return bad + MAC.tag(bad)


FUZZ_KINDS = ("random", "truncated", "header-not-object", "header-bad-fields", "short-payload",
              "wrong-shape", "flipped-byte", "other-key")  # fmt: skip


def test_fuzzed_records_are_counted_misses_not_errors(shared: Shared) -> None:
    client = shared.client()
    client.flushall()
    prompt = random_prompt(700, seed=77)
    chunks = 700 // BLOCK  # 5 full chunks, 4 layers each
    cold = shared.fresh(prompt)
    assert cached_tokens(cold) == 0
    _wait_for(lambda: client.dbsize() == chunks * LAYERS)
    keys = sorted(k.decode() for k in client.keys("kv:*"))
    valid = {k: client.get(k) for k in keys}
    expected = {k: _parse(v[: -codec.TAG_BYTES])[0] for k, v in valid.items()}
    warm = shared.fresh(prompt)
    assert cached_tokens(warm) == (700 - 1) // BLOCK * BLOCK  # the keys above are this prompt's
    assert_same(warm, cold)

    def restored() -> bool:
        """Every key holds a valid record again (the server re-saves what it recomputed)."""
        for k in keys:
            rec = client.get(k)
            h = expected[k]
            try:
                codec.decode(rec, codec.Expected(k, torch.float32, tuple(h["shape"])), mac=MAC)
            except (codec.IntegrityError, TypeError):
                return False
        return True

    rng = random.Random(2024)
    for rnd in range(2 * len(FUZZ_KINDS)):
        # Each round fuzzes every key, with kinds rotating over keys and rounds; odd
        # rounds leave the first two chunks valid (a partial hit, then recompute).
        planted = keys if rnd % 2 == 0 else keys[2 * LAYERS :]
        for i, k in enumerate(planted):
            kind = FUZZ_KINDS[(rnd // 2 + i) % len(FUZZ_KINDS)]
            client.set(k, _fuzz(kind, valid[k], valid[keys[(i + 1) % len(keys)]], rng))
        before = shared.metrics()
        got = shared.fresh(prompt)
        after = shared.metrics()
        assert_same(got, cold)
        misses = after.get("kvcache_miss_chunks_total{reason=integrity}", 0) - before.get(
            "kvcache_miss_chunks_total{reason=integrity}", 0
        )
        assert misses >= 1, (rnd, after)
        _wait_for(restored)
    log = shared.server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "EngineDeadError" not in log
    assert "not loadable (integrity)" in log
    final = shared.fresh(prompt)  # and the server still serves hits from what it re-saved
    assert cached_tokens(final) == (700 - 1) // BLOCK * BLOCK
    assert_same(final, cold)


def test_cache_salt_separates_tenants(shared: Shared) -> None:
    """vLLM's per-request cache_salt: one tenant's stored prefix is never another's hit.

    One server and two salts share one Redis (cheaper than two servers and the same keys:
    with L1 off every lookup and load goes through the shared Redis)."""
    client = shared.client()
    client.flushall()
    prompt = random_prompt(700, seed=78)
    per_prompt = 700 // BLOCK * LAYERS
    loadable = (700 - 1) // BLOCK * BLOCK

    def l2_hits() -> float:
        return shared.metrics().get("kvcache_hit_chunks_total{tier=l2}", 0.0)

    a = shared.fresh(prompt, salt="tenant-a")
    assert cached_tokens(a) == 0
    _wait_for(lambda: client.dbsize() == per_prompt)
    hits = l2_hits()
    b = shared.fresh(prompt, salt="tenant-b")
    unsalted = shared.fresh(prompt)
    assert cached_tokens(b) == 0 and cached_tokens(unsalted) == 0
    assert l2_hits() == hits  # no lookup or load touched tenant a's records
    assert_same(b, a)
    assert_same(unsalted, a)
    _wait_for(lambda: client.dbsize() == 3 * per_prompt)  # each stored under its own keys
    a2 = shared.fresh(prompt, salt="tenant-a")
    assert cached_tokens(a2) == loadable  # the owner still hits
    assert l2_hits() == hits + loadable // BLOCK
    assert_same(a2, a)


def test_redis_password_is_used_but_never_shown(shared: Shared) -> None:
    """The password comes from a file: the server authenticates (it stores and hits), and the
    password is in neither its command line nor its log, even when Redis goes away and the
    connector logs the store's URL."""
    client = shared.client()
    client.flushall()
    prompt = random_prompt(600, seed=79)
    first = shared.fresh(prompt)
    _wait_for(lambda: client.dbsize() == 600 // BLOCK * LAYERS)  # writes authenticated
    assert cached_tokens(shared.fresh(prompt)) == (600 - 1) // BLOCK * BLOCK
    shared.redis.stop()
    try:
        down = shared.fresh(prompt)  # lookups fail: the connector logs the outage
        assert cached_tokens(down) == 0
        assert_same(down, first)
    finally:
        shared.redis.start()
    time.sleep(0.6)  # past l2_redis_retry_s
    log = shared.server.log_path.read_text(errors="replace")
    assert "unreachable" in log and "Redis L2 at redis://127.0.0.1" in log
    assert PLANTED_PASSWORD not in log
    assert not any(PLANTED_PASSWORD in arg for arg in shared.server.cmd)
    assert shared.server.proc is not None
    argv = Path(f"/proc/{shared.server.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert PLANTED_PASSWORD not in argv


def test_planted_record_without_the_mac_key_is_a_miss(shared: Shared) -> None:
    """Someone who can write to Redis but lacks the MAC key plants records under a prompt's
    keys: well formed, right key, right layout, right checksum, made from the real KV
    (so without the MAC they would load). Every one is a counted miss; the prompt is
    recomputed and the server's own, tagged records replace them."""
    client = shared.client()
    client.flushall()
    prompt = random_prompt(700, seed=80)
    cold = shared.fresh(prompt)
    _wait_for(lambda: client.dbsize() == 700 // BLOCK * LAYERS)
    keys = sorted(k.decode() for k in client.keys("kv:*"))
    for k in keys:  # re-encode the real payload without a tag (or with another key's tag)
        header, payload = _parse(client.get(k)[: -codec.TAG_BYTES])
        t = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(header["shape"])
        forged = codec.encode(k, t, mac=codec.Mac(b"not-the-key")) if k.endswith("L0") else codec.encode(k, t)
        client.set(k, forged)
    before = shared.metrics()
    got = shared.fresh(prompt)
    after = shared.metrics()
    assert_same(got, cold)
    assert after.get("kvcache_hit_chunks_total{tier=l2}", 0) == before.get(
        "kvcache_hit_chunks_total{tier=l2}", 0
    )
    misses = after.get("kvcache_miss_chunks_total{reason=integrity}", 0) - before.get(
        "kvcache_miss_chunks_total{reason=integrity}", 0
    )
    assert misses == 700 // BLOCK  # every chunk of the prompt
    # The recomputed chunks are stored again with the server's tag, and load.
    _wait_for(lambda: all(_tagged(client.get(k)) for k in keys))
    hit = shared.fresh(prompt)
    assert cached_tokens(hit) == (700 - 1) // BLOCK * BLOCK
    assert_same(hit, cold)


def _tagged(record: bytes | None) -> bool:
    return record is not None and MAC.tag(record[: -codec.TAG_BYTES]) == record[-codec.TAG_BYTES :]
