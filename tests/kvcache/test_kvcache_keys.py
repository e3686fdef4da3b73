from dataclasses import replace

from kvcache.fingerprint import weights_fingerprint
from kvcache.keys import KeyNamespace, chunk_hashes, layer_number, storage_key

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


def test_namespace_separates_kv_dtype_weights_and_salt() -> None:
    """What changes KV bytes (or who may read them) for the same tokens never shares a key."""
    tokens = list(range(8))
    fp8a = replace(NS, kv_cache_dtype="fp8_e4m3/torch.uint8")
    fp8b = replace(NS, kv_cache_dtype="fp8_e5m2/torch.uint8")  # same storage dtype, other bytes
    w1, w2 = replace(NS, weights="aa"), replace(NS, weights="bb")
    variants = {
        "base": chunk_hashes(NS, tokens),
        "fp8_e4m3": chunk_hashes(fp8a, tokens),
        "fp8_e5m2": chunk_hashes(fp8b, tokens),
        "weights-aa": chunk_hashes(w1, tokens),
        "weights-bb": chunk_hashes(w2, tokens),
        "salt-a": chunk_hashes(NS, tokens, salt="tenant-a"),
        "salt-b": chunk_hashes(NS, tokens, salt="tenant-b"),
    }
    firsts = [h[0] for h in variants.values()]
    seconds = [h[1] for h in variants.values()]
    assert len(set(firsts)) == len(firsts) and len(set(seconds)) == len(seconds)
    # Deterministic, and no salt is the same as an empty one (vLLM sends None).
    assert chunk_hashes(NS, tokens, salt="tenant-a") == variants["salt-a"]
    assert chunk_hashes(NS, tokens, salt="") == chunk_hashes(NS, tokens, salt=None) == variants["base"]
    # A salted chain is still a chain: a shared prefix under one salt shares keys.
    longer = chunk_hashes(NS, tokens + [9, 9, 9, 9], salt="tenant-a")
    assert longer[:2] == variants["salt-a"]


def test_layer_number_is_the_global_index() -> None:
    assert layer_number("model.layers.17.self_attn.attn") == 17
    assert layer_number("language_model.model.layers.3.attn") == 3
    assert layer_number("attn") is None


def test_weights_fingerprint_follows_content_not_mtime(tmp_path) -> None:
    import os
    import shutil

    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 8}')
    weights = bytearray(os.urandom(3 << 20))
    (a / "model.safetensors").write_bytes(weights)
    fp = weights_fingerprint(str(a))
    assert len(fp) == 32
    b = tmp_path / "b"
    shutil.copytree(a, b)  # another node's copy: other path, other mtimes
    os.utime(b / "model.safetensors", (1, 1))
    weights_fingerprint.cache_clear()
    assert weights_fingerprint(str(b)) == fp
    weights[len(weights) // 2] ^= 1  # fine-tuned in place: same size, same config
    (b / "model.safetensors").write_bytes(weights)
    weights_fingerprint.cache_clear()
    assert weights_fingerprint(str(b)) != fp
    (a / "config.json").write_text('{"hidden_size": 16}')
    weights_fingerprint.cache_clear()
    assert weights_fingerprint(str(a)) != fp
    assert weights_fingerprint("meta-llama/Llama-3.1-8B") == ""  # a hub id: not a local dir
