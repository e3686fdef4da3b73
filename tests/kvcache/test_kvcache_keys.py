from dataclasses import replace

from kvcache.keys import KeyNamespace, chunk_hashes, storage_key

NS = KeyNamespace(
    model="m@",
    dtype="torch.float32",
    block_size=4,
    chunk_tokens=4,
    num_layers=2,
    kv_heads=2,
    head_size=8,
    kv_layout="cpu/None/FullAttentionSpec",
    tp_size=1,
)


def test_only_full_chunks_get_keys() -> None:
    assert len(chunk_hashes(NS, list(range(11)))) == 2
    assert len(chunk_hashes(NS, list(range(12)))) == 3
    assert chunk_hashes(NS, list(range(3))) == []
    assert len(chunk_hashes(NS, list(range(12)), max_tokens=8)) == 2


def test_chain_covers_the_whole_prefix() -> None:
    a = chunk_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chunk_hashes(NS, [9, 2, 3, 4, 5, 6, 7, 8])  # same second chunk, different first
    assert a[1] != b[1]
    c = chunk_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
    assert c[:2] == a  # a shared prefix shares keys


def test_namespace_separates_models_and_layouts() -> None:
    tokens = list(range(8))
    base = chunk_hashes(NS, tokens)
    for change in (
        {"model": "other@"},
        {"dtype": "torch.bfloat16"},
        {"kv_layout": "cuda/NHD/FullAttentionSpec"},
        {"tp_size": 2},
        {"kv_heads": 4},
        {"extra": "rev2"},
    ):
        other = replace(NS, **change)
        assert other.prefix() != NS.prefix()
        assert chunk_hashes(other, tokens)[0] != base[0], change


def test_storage_key_has_rank_and_layer() -> None:
    k0 = storage_key("ns", 0, "abc", 1)
    assert k0 != storage_key("ns", 1, "abc", 1)
    assert k0 != storage_key("ns", 0, "abc", 2)
