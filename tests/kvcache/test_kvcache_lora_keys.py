"""Keys of LoRA requests (no vLLM): the adapter's identity roots the chain.

The adapters are real PEFT-format directories written by inference_images/vllm/make_lora.py
(the generator the end-to-end test serves), so the fingerprint is checked on the files
vLLM would load.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvcache_testlib import load_make_lora
from test_kvcache_keys import NS  # the namespace the key tests use

from kvcache import adapters
from kvcache.adapters import AdapterUnavailable, adapter_fingerprint, adapter_identity
from kvcache.keys import chain_root, chunk_hashes

make_lora = load_make_lora()

TOKENS = list(range(8))
# chunk_hashes(NS, TOKENS) and with salt="tenant-a", computed by the connector before LoRA
# requests were cached (c74d59a): base and salted keys must not change, or every record
# already in a shared L2 would turn into a miss after an upgrade.
BASE_KEYS = ["0b86b366c441c34ab596cd9d31544ea7", "42c75251278abecf3c96a4d54656abe4"]
SALTED_KEYS = ["914ff3149e5f0fd4cd757e55c34298e1", "a64788fe3c86b00291417d74216d6f60"]


@dataclass
class Lora:
    """The fields of vLLM's LoRARequest that the connector reads."""

    lora_name: str
    lora_path: str
    lora_int_id: int = 1


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    adapters.clear_cache()


def _base_config(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(
        '{"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2}'
    )
    return root


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return _base_config(tmp_path / "base")


def test_base_and_salted_keys_are_unchanged() -> None:
    assert chunk_hashes(NS, TOKENS) == BASE_KEYS
    assert chunk_hashes(NS, TOKENS, salt="tenant-a") == SALTED_KEYS
    assert chain_root(NS, None, None) == chain_root(NS, "", "") == NS.digest()


def test_adapters_base_and_salts_never_share_a_key(base: Path, tmp_path: Path) -> None:
    a1 = adapter_identity(Lora("a1", str(make_lora(base, tmp_path / "a1", seed=1))))
    a2 = adapter_identity(Lora("a2", str(make_lora(base, tmp_path / "a2", seed=2))))
    variants = {
        "base": chunk_hashes(NS, TOKENS),
        "salt": chunk_hashes(NS, TOKENS, salt="tenant-a"),
        "a1": chunk_hashes(NS, TOKENS, adapter=a1),
        "a2": chunk_hashes(NS, TOKENS, adapter=a2),
        "a1+salt": chunk_hashes(NS, TOKENS, salt="tenant-a", adapter=a1),
        # A salt equal to the identity string is mixed under another personalisation.
        "salt=a1": chunk_hashes(NS, TOKENS, salt=a1),
    }
    keys = [k for hashes in variants.values() for k in hashes]
    assert len(set(keys)) == len(keys)
    # Deterministic, and still a chain: a longer prompt under a1 extends a1's keys.
    assert chunk_hashes(NS, TOKENS + [9, 9, 9, 9], adapter=a1)[:2] == variants["a1"]


def test_identity_follows_content_not_path(base: Path, tmp_path: Path) -> None:
    one = make_lora(base, tmp_path / "one", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)  # another node's copy of the same adapter
    ident = adapter_identity(Lora("a1", str(one)))
    assert ident == adapter_identity(Lora("a1", str(copy)))
    # Same name, other weights (a redeploy): another identity.
    other = make_lora(base, tmp_path / "other", seed=2)
    assert adapter_identity(Lora("a1", str(other))) != ident
    # Same weights under another name: kept apart too (the name is part of the identity).
    assert adapter_identity(Lora("b1", str(one))) != ident


def test_one_changed_byte_changes_the_fingerprint(base: Path, tmp_path: Path) -> None:
    root = make_lora(base, tmp_path / "a", seed=1)
    before = adapter_fingerprint(str(root))
    assert adapter_fingerprint(str(root)) == before  # cached, same answer
    weights = root / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # replaced in place: same size, same config
    weights.write_bytes(bytes(data))
    changed = adapter_fingerprint(str(root))
    assert changed != before
    config = root / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    assert adapter_fingerprint(str(root)) not in (before, changed)


def test_adapters_that_cannot_be_fingerprinted_say_why(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdapterUnavailable with the reason the connector counts (the request then bypasses
    the cache); a first warning once per adapter name."""
    big = make_lora(base, tmp_path / "big", seed=1)
    cases = {
        "some-org/some-adapter": "not_local",  # a hub id vLLM resolves on the worker
        "": "not_local",  # not the working directory
        str(_base_config(tmp_path / "empty")): "no_weights",
        str(big): "too_big",
    }
    monkeypatch.setattr(adapters, "MAX_ADAPTER_BYTES", (big / "adapter_model.safetensors").stat().st_size)
    for path, reason in cases.items():
        with pytest.raises(AdapterUnavailable) as err:
            adapter_identity(Lora("x", path))
        assert err.value.reason == reason, path
    assert adapters.first_warning("x") and not adapters.first_warning("x")


def test_scheduler_saves_and_finds_a_lora_request_under_its_adapter(base: Path, tmp_path: Path) -> None:
    """The scheduler's side without vLLM: a LoRA request is saved (it used to be skipped)
    under its adapter's keys, and only the same adapter finds them in L2."""
    from types import SimpleNamespace

    from kvcache.config import KVCacheSettings
    from kvcache.keys import storage_key
    from kvcache.scheduler import KVCacheScheduler
    from kvcache.tiers import FilesystemStore

    store = FilesystemStore(str(tmp_path / "l2"))
    sched = KVCacheScheduler(KVCacheSettings.from_extra({}), NS, NS.block_size, store)
    a1 = adapter_identity(Lora("a1", str(make_lora(base, tmp_path / "a1", seed=1))))
    a2 = adapter_identity(Lora("a2", str(make_lora(base, tmp_path / "a2", seed=2))))
    prompt = list(range(100, 117))  # 4 full chunks + 1 token: all 4 loadable
    assert sched.num_matched_tokens("r1", prompt, 0, adapter=a1) == 0
    new = SimpleNamespace(
        req_id="r1", block_ids=([10, 11, 12, 13, 14],), prompt_token_ids=prompt, num_computed_tokens=0,
        mm_features=None, lora_request=Lora("a1", "unused"), prompt_embeds=None,
    )  # fmt: skip
    step = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        num_scheduled_tokens={"r1": len(prompt)},
    )
    saves = [s.chunk_hash for s in sched.build_meta(step, {}).saves]
    assert saves == chunk_hashes(NS, prompt, adapter=a1)
    sched.finished("r1")
    for h in saves:  # what the worker would write to L2
        for layer in range(NS.num_layers):
            store.put(storage_key(sched.ns, 0, h, layer), b"record")
    found = {
        name: sched.num_matched_tokens(name, prompt, 0, adapter=ident)
        for name, ident in (("a1", a1), ("a2", a2), ("base", None))
    }
    assert found == {"a1": 16, "a2": 0, "base": 0}
