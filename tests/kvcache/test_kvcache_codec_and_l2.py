import pytest
import torch

from kvcache import codec
from kvcache.tiers import FilesystemStore, RedisStore, TierUnavailable
from kvcache.tiers.writer import L2Writer


def _expected(key: str, t: torch.Tensor) -> codec.Expected:
    return codec.Expected(key, t.dtype, tuple(t.shape))


def test_roundtrip_and_checks() -> None:
    t = torch.randn(2, 3, 4)
    rec = codec.encode("k1", t)
    out, crc = codec.decode(rec, _expected("k1", t))
    assert torch.equal(out, t) and crc == codec.checksum(t)
    with pytest.raises(codec.IntegrityError, match="key"):
        codec.decode(rec, _expected("k2", t))
    with pytest.raises(codec.IntegrityError, match="layout"):
        codec.decode(rec, codec.Expected("k1", torch.float32, (3, 2, 4)))
    with pytest.raises(codec.IntegrityError, match="layout"):
        codec.decode(rec, codec.Expected("k1", torch.float16, (2, 3, 4)))
    flipped = bytearray(rec)
    flipped[-1] ^= 0x40
    with pytest.raises(codec.IntegrityError, match="checksum"):
        codec.decode(bytes(flipped), _expected("k1", t))
    with pytest.raises(codec.IntegrityError):
        codec.decode(rec[:-4], _expected("k1", t))
    with pytest.raises(codec.IntegrityError):
        codec.decode(b"junk", _expected("k1", t))


def _exercise(store) -> None:
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    assert store.get("kv:ns:r0:aa:L0") is None
    store.put("kv:ns:r0:aa:L0", codec.encode("kv:ns:r0:aa:L0", t))
    store.put("kv:ns:r0:aa:L1", codec.encode("kv:ns:r0:aa:L1", t))
    store.put("kv:ns:r0:bb:L0", codec.encode("kv:ns:r0:bb:L0", t))
    out, _ = codec.decode(store.get("kv:ns:r0:aa:L0"), _expected("kv:ns:r0:aa:L0", t))
    assert torch.equal(out, t)
    groups = [["kv:ns:r0:aa:L0", "kv:ns:r0:aa:L1"], ["kv:ns:r0:bb:L0", "kv:ns:r0:bb:L1"], ["kv:ns:r0:aa:L0"]]
    assert store.present(groups) == [True, False, True]


def test_filesystem_store(tmp_path) -> None:
    store = FilesystemStore(str(tmp_path))
    _exercise(store)
    # Another process's view: a fresh store on the same directory sees the records.
    assert FilesystemStore(str(tmp_path)).get("kv:ns:r0:aa:L0") is not None
    assert not list(tmp_path.rglob(".tmp-*"))


@pytest.mark.service
def test_redis_store(redis_server) -> None:
    _exercise(RedisStore(redis_server.url))


@pytest.mark.service
def test_redis_down_is_unavailable_then_recovers(redis_server) -> None:
    store = RedisStore(redis_server.url, timeout_s=0.2, retry_s=0.3)
    store.put("kv:a", b"x")
    redis_server.stop()
    with pytest.raises(TierUnavailable):
        store.get("kv:a")
    # While marked down, calls fail fast instead of waiting for a timeout each.
    with pytest.raises(TierUnavailable):
        store.present([["kv:a"]])
    assert store.is_down
    redis_server.start()  # same port, empty (no persistence)
    import time

    time.sleep(0.35)
    assert store.get("kv:a") is None
    assert not store.is_down


@pytest.mark.service
def test_writer_is_async_and_survives_outage(redis_server) -> None:
    store = RedisStore(redis_server.url, timeout_s=0.2, retry_s=0.1)
    writer = L2Writer(store, max_queue=8)
    t = torch.ones(4)
    assert writer.submit("kv:w1", t, codec.checksum(t))
    assert writer.flush()
    assert redis_server.client().exists("kv:w1") == 1
    redis_server.stop()
    writer.submit("kv:w2", t, codec.checksum(t))
    assert writer.flush()
    assert writer.failed >= 1
    redis_server.start()
    import time

    time.sleep(0.15)
    writer.submit("kv:w3", t, codec.checksum(t))
    assert writer.flush()
    assert redis_server.client().exists("kv:w3") == 1
    writer.close()


def test_writer_drops_when_queue_full(tmp_path) -> None:
    class SlowStore(FilesystemStore):
        def put(self, key, record):
            import time

            time.sleep(0.2)
            super().put(key, record)

    writer = L2Writer(SlowStore(str(tmp_path)), max_queue=2)
    t = torch.ones(4)
    results = [writer.submit(f"kv:n:r0:h{i}:L0", t, codec.checksum(t)) for i in range(10)]
    assert not all(results) and writer.dropped == results.count(False)
    writer.close()


def _malformed(rec: bytes, t: torch.Tensor) -> list[bytes]:
    """Records a writer to the shared tier could leave under a key: each must be a miss."""
    import json
    import random
    import struct

    rng = random.Random(7)
    head = struct.Struct("<4sI")
    header_len = head.unpack_from(rec)[1]
    header = json.loads(rec[head.size : head.size + header_len])
    payload = rec[head.size + header_len :]

    def with_header(h: object, body: bytes = payload) -> bytes:
        raw = json.dumps(h).encode()
        return head.pack(b"KVC1", len(raw)) + raw + body

    short = payload[: len(payload) // 2]
    out = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))) for _ in range(20)]
    out += [rec[:n] for n in sorted(rng.sample(range(len(rec)), 20))]  # truncated anywhere
    out += [
        head.pack(b"KVC1", 10**6) + rec[head.size :],  # header length beyond the record
        head.pack(b"KVC1", 3) + b"\xff\xfe\x00" + payload,  # header not UTF-8
        with_header([1, 2, 3]),
        with_header("a string"),
        with_header(None),
        with_header({**header, "sum": "abc"}),
        with_header({**header, "sum": None}),
        with_header({**header, "sum": 1.5}),
        with_header({**header, "sum": -1}),
        with_header({**header, "sum_alg": "md5"}),
        with_header({**header, "mac": "blake2b"}),  # claims a tag it does not have
        with_header({**header, "nbytes": "x"}),
        with_header({**header, "shape": "2,3,4"}),
        with_header({**header, "shape": [2, "3", 4]}),
        with_header({**header, "shape": None}),
        with_header({**header, "dtype": ["float32"]}),
        # The header agrees with a short payload: nbytes matches, shape x element size not.
        with_header({**header, "nbytes": len(short)}, short),
        with_header({**header, "nbytes": len(payload) + 4}, payload + b"\0\0\0\0"),
        # Another shape's tensor, labelled with the expected shape.
        with_header({**header, "nbytes": 4 * 6}, torch.ones(2, 3).numpy().tobytes()),
    ]
    return out


def test_malformed_records_are_integrity_errors_only() -> None:
    t = torch.randn(2, 3, 4)
    rec = codec.encode("k1", t)
    for bad in _malformed(rec, t):
        for verify in (True, False):
            with pytest.raises(codec.IntegrityError):
                codec.decode(bad, _expected("k1", t), verify)
    # memoryview / bytearray inputs (any buffer a store may return) still decode.
    out, _ = codec.decode(memoryview(bytearray(rec)), _expected("k1", t))
    assert torch.equal(out, t)


def test_secrets_masked_and_read_from_env_or_file(tmp_path, monkeypatch) -> None:
    from kvcache.secrets import mask_url, read_secret

    assert mask_url("redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url("rediss://user:hunter2@r.example:6380/1") == "rediss://user:***@r.example:6380/1"
    assert mask_url("redis://redis:6379/0") == "redis://redis:6379/0"
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    monkeypatch.delenv("KV_TEST_PW", raising=False)
    assert read_secret("KV_TEST_PW", str(f)) == "from-file"
    monkeypatch.setenv("KV_TEST_PW", "from-env")
    assert read_secret("KV_TEST_PW", str(f)) == "from-env"
    assert read_secret("", "") is None


@pytest.mark.service
def test_redis_password_from_env_and_never_logged(tmp_path, monkeypatch, caplog) -> None:
    """Against a redis-server that requires a password: the store authenticates with the one
    from the environment; a password left in the URL is masked in every log line."""
    from kvcache_testlib import RedisServer

    from kvcache.config import KVCacheSettings
    from kvcache.tiers import make_l2

    planted = "planted-Pw-0d9e1"
    srv = RedisServer(password=planted).start()
    try:
        monkeypatch.setenv("KVCACHE_REDIS_PASSWORD", planted)
        with caplog.at_level("INFO", logger="vllm.kvcache"):
            store = make_l2(KVCacheSettings.from_extra({"l2_backend": "redis", "l2_redis_url": srv.url}))
            assert store is not None
            store.put("kv:x", b"1")
            assert store.get("kv:x") == b"1"
            leaky = RedisStore(f"redis://:{planted}@127.0.0.1:{srv.port}/0", timeout_s=0.2)
            assert leaky.get("kv:x") == b"1"
            srv.stop()
            for s in (store, leaky):
                with pytest.raises(TierUnavailable) as exc:
                    s.get("kv:x")
                assert planted not in str(exc.value)
        text = caplog.text
        assert "unreachable" in text and ":***@" in text and "l2_redis_password_env" in text
        assert planted not in text
    finally:
        srv.stop()


@pytest.mark.parametrize("alg", ["blake2b", "blake3"])
def test_mac_records(alg: str) -> None:
    """With a key, only records tagged with that key decode; the tag covers every byte."""
    t = torch.randn(4, 8)
    mac = codec.Mac(b"secret", alg)
    rec = codec.encode("k", t, mac=mac)
    out, _ = codec.decode(rec, _expected("k", t), mac=mac)
    assert torch.equal(out, t)
    out, _ = codec.decode(rec, _expected("k", t))  # a reader without the key still parses it
    assert torch.equal(out, t)
    for bad in (
        codec.encode("k", t),  # no tag: a writer without the key
        codec.encode("k", t, mac=codec.Mac(b"other", alg)),  # another key
        rec[:-1] + bytes([rec[-1] ^ 1]),  # a flipped tag bit
        rec[:40] + bytes([rec[40] ^ 1]) + rec[41:],  # a flipped header bit
        rec[:-40] + bytes([rec[-40] ^ 1]) + rec[-39:],  # a flipped payload bit
    ):
        with pytest.raises(codec.IntegrityError):
            codec.decode(bad, _expected("k", t), mac=mac)
    for bad in _malformed(codec.encode("k", t), t):  # malformed content with a valid tag
        if b'"mac": "' in bad:
            continue  # claims a tag, and gets a valid one appended here: a good record
        with pytest.raises(codec.IntegrityError):
            codec.decode(bad + mac.tag(bad), _expected("k", t), mac=mac)


def _record_bound(t: torch.Tensor) -> int:
    return codec.max_record_bytes(t.numel() * t.element_size())


def test_a_hostile_fs_tier_cannot_hang_or_exhaust_the_reader(tmp_path) -> None:
    # Issue 19, finding 6: a FIFO at a record's path blocked the forward pass and a link to
    # /dev/zero took the whole memory cap in one read. Each is now refused at once, a miss.
    import os
    import threading

    from kvcache.tiers import RecordRefused

    store = FilesystemStore(str(tmp_path))
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    bound = _record_bound(t)
    store.put("kv:ns:r0:aa:L0", codec.encode("kv:ns:r0:aa:L0", t))
    fifo, zero, big = (store._path(f"kv:ns:r0:{h}:L0") for h in ("ff", "dd", "bb"))
    for path in (fifo, zero, big):
        path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    big.write_bytes(b"\0" * (bound + 1))
    outcome: dict[str, object] = {}

    def read_all() -> None:
        for key in ("kv:ns:r0:ff:L0", "kv:ns:r0:dd:L0", "kv:ns:r0:bb:L0"):
            try:
                outcome[key] = store.get(key, max_bytes=bound)
            except RecordRefused as exc:
                outcome[key] = exc

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a read of the hostile tier blocked"
    assert all(isinstance(v, RecordRefused) for v in outcome.values()), outcome
    # The legitimate record beside them is read as before.
    out, _ = codec.decode(store.get("kv:ns:r0:aa:L0", max_bytes=bound), _expected("kv:ns:r0:aa:L0", t))
    assert torch.equal(out, t)


@pytest.mark.service
def test_an_oversize_redis_value_is_refused_without_reading_it_whole(redis_server) -> None:
    import redis as redis_client

    from kvcache.tiers import RecordRefused

    store = RedisStore(redis_server.url)
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    bound = _record_bound(t)
    store.put("kv:ns:r0:aa:L0", codec.encode("kv:ns:r0:aa:L0", t))
    redis_client.Redis.from_url(redis_server.url).set("kv:ns:r0:bb:L0", b"\0" * (64 << 20))  # 64 MiB
    with pytest.raises(RecordRefused):
        store.get("kv:ns:r0:bb:L0", max_bytes=bound)
    assert store.get("kv:ns:r0:cc:L0", max_bytes=bound) is None  # absent stays absent
    out, _ = codec.decode(store.get("kv:ns:r0:aa:L0", max_bytes=bound), _expected("kv:ns:r0:aa:L0", t))
    assert torch.equal(out, t)


def test_a_link_at_a_fan_out_directory_leads_no_record_out_of_the_tier(tmp_path) -> None:
    """A second review's variant of finding 6: O_NOFOLLOW covers only the last component, so a
    link planted at ``<root>/ab`` sent writes (prompt-derived records) elsewhere and served
    reads from there. Every access is now relative to the fan-out directory, opened unfollowed."""
    from kvcache.tiers import RecordRefused

    root, elsewhere = tmp_path / "l2", tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = FilesystemStore(str(root))
    t = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    store.put("kv:ns:r0:cd:L0", codec.encode("kv:ns:r0:cd:L0", t))  # a legitimate record
    (root / "ab").symlink_to(elsewhere)
    (elsewhere / "kv_ns_r0_ab_L0").write_bytes(codec.encode("kv:ns:r0:ab:L0", t))  # planted
    with pytest.raises(TierUnavailable):
        store.put("kv:ns:r0:ab:L1", codec.encode("kv:ns:r0:ab:L1", t))
    assert sorted(p.name for p in elsewhere.iterdir()) == ["kv_ns_r0_ab_L0"]  # nothing written there
    with pytest.raises(RecordRefused, match="not a directory of this tier"):
        store.get("kv:ns:r0:ab:L0")
    assert store.present([["kv:ns:r0:ab:L0"], ["kv:ns:r0:cd:L0"]]) == [False, True]
    out, _ = codec.decode(store.get("kv:ns:r0:cd:L0"), _expected("kv:ns:r0:cd:L0", t))
    assert torch.equal(out, t)
    store.close()
