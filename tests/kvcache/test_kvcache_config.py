import pytest

from kvcache.config import KVCacheSettings


def test_defaults_and_parsing() -> None:
    s = KVCacheSettings.from_extra({"mode": "sync", "l1_capacity_bytes": "1024", "verify_checksum": "false"})
    assert s.mode == "sync" and not s.pipelined
    assert s.l1_capacity_bytes == 1024 and s.verify_checksum is False
    assert KVCacheSettings.from_extra(None).chunk_size(128) == 128


@pytest.mark.parametrize(
    "extra",
    [{"mode": "fast"}, {"l2_backend": "s3"}, {"l2_backend": "fs"}, {"l1_eviction": "mru"}, {"typo_key": 1}],
)
def test_bad_settings_fail_loudly(extra) -> None:
    with pytest.raises(ValueError):
        KVCacheSettings.from_extra(extra)


def test_chunk_must_be_block_multiple() -> None:
    s = KVCacheSettings.from_extra({"chunk_tokens": 192})
    with pytest.raises(ValueError):
        s.chunk_size(128)
    assert KVCacheSettings.from_extra({"chunk_tokens": 256}).chunk_size(128) == 256


def test_l1_checksum_values() -> None:
    assert KVCacheSettings.from_extra(None).l1_checksum == "full"  # xxh3-64 of every byte
    assert KVCacheSettings.from_extra({"l1_checksum": True}).l1_checksum == "full"
    assert KVCacheSettings.from_extra({"l1_checksum": False}).l1_checksum == "off"
    assert KVCacheSettings.from_extra({"l1_checksum": "full"}).l1_checksum == "full"
    with pytest.raises(ValueError):
        KVCacheSettings.from_extra({"l1_checksum": "md5"})
