"""L1 store/load bandwidth of the connector's worker path vs a plain torch copy of the same bytes.

Drives KVCacheWorker (no vLLM server) on paged KV tensors shaped like the bench model's
(8 layers, 8 KV heads, head dim 128 -> CPU layout [blocks, heads, 128, 256]): a "store" is
save_kv_layer for every layer + wait_for_save (copy into L1 slab slots + L1 check values +
L1 insert); a "load" is start_load_kv + wait_for_layer_load for every layer (verify +
copy into the paged cache). The baseline is ``dst.copy_(src)`` over the same number of
bytes, in the same run, into memory touched before (like the slab's after its first use).
The baseline copy is timed in every round right next to that round's store and load, and
the reported share is the median of the per-round ratios, so that a burst of load from
elsewhere on a shared machine slows both sides of one ratio rather than one side of the
whole comparison.

Steady state: two unmeasured rounds fill the pool (capacity = two rounds), so measured
saves reuse evicted slots. One line per ``l1_checksum`` setting. Then the cost of L2
records per GiB: encode and decode with the checksum only, and with each MAC.

    .venv-inference/bin/python bench/kvcache_l1_bandwidth.py [--tokens 1664] [--repeat 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache import codec  # noqa: E402
from kvcache.config import KVCacheSettings  # noqa: E402
from kvcache.metadata import ChunkTransfer, KVCacheStepMetadata  # noqa: E402
from kvcache.worker import KVCacheWorker  # noqa: E402


def run(tokens: int, repeat: int, l1_checksum: str, layers: int = 8, heads: int = 8, head_dim: int = 128,
        block: int = 128, warmup: int = 2) -> dict[str, float]:  # fmt: skip
    n_chunks = tokens // block
    num_blocks = 2 * n_chunks + 4
    kv = {
        f"model.layers.{i}.attn": torch.randn(num_blocks, heads, block, 2 * head_dim) for i in range(layers)
    }
    nbytes = layers * n_chunks * heads * block * 2 * head_dim * 4
    settings = KVCacheSettings.from_extra({"l1_checksum": l1_checksum, "l1_capacity_bytes": 2 * nbytes})
    worker = KVCacheWorker(settings, "bench", 0, None)
    worker.register_kv_caches(kv, num_blocks, block)
    names = list(worker.layer_index)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages first, like the pool's warm memory
    store_t, load_t, copy_t = [], [], []
    store_ratio, load_ratio = [], []
    for r in range(warmup + repeat):
        saves = [ChunkTransfer(f"r{r}c{c}", [(0, c)], "req") for c in range(n_chunks)]
        meta = KVCacheStepMetadata(saves=saves, chunk_tokens=block)
        t0 = time.perf_counter()
        for name in names:
            worker.save_layer(name, meta)
        worker.wait_for_save(meta)
        t_store = time.perf_counter() - t0

        loads = [ChunkTransfer(f"r{r}c{c}", [(0, n_chunks + c)], "req") for c in range(n_chunks)]
        meta = KVCacheStepMetadata(loads=loads, chunk_tokens=block)
        t0 = time.perf_counter()
        worker.start_load(meta)
        for name in names:
            worker.wait_for_layer(name)
        assert not worker.take_load_errors()
        t_load = time.perf_counter() - t0

        t0 = time.perf_counter()
        dst.copy_(src)
        t_copy = time.perf_counter() - t0
        if r >= warmup:
            store_t.append(t_store)
            load_t.append(t_load)
            copy_t.append(t_copy)
            store_ratio.append(t_copy / t_store)
            load_ratio.append(t_copy / t_load)
    for t in kv.values():  # the loaded blocks equal the saved ones
        assert torch.equal(t[n_chunks : 2 * n_chunks], t[:n_chunks])
    assert worker.l1.bytes_used <= 2 * nbytes
    worker.shutdown()
    gib = nbytes / 2**30
    return {
        "bytes": nbytes,
        "copy_gibs": gib / statistics.median(copy_t),
        "store_gibs": gib / statistics.median(store_t),
        "load_gibs": gib / statistics.median(load_t),
        "store_share": statistics.median(store_ratio),
        "load_share": statistics.median(load_ratio),
    }


def l2_record_costs(mib: int = 64, repeat: int = 5) -> dict[str, float]:
    """ms per GiB to encode + decode (verify) L2 records: checksum only vs each MAC. The
    write-behind thread pays encode, a load thread decode; neither runs on the forward's
    thread on a GPU, but on CPU they share its cores."""
    t = torch.randn(mib << 18)
    expected = codec.Expected("k", t.dtype, tuple(t.shape))
    out: dict[str, float] = {}
    for name, mac in (("checksum", None), ("blake2b", codec.Mac(b"k", "blake2b")),
                      ("blake3", codec.Mac(b"k", "blake3"))):  # fmt: skip
        enc, dec = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            rec = codec.encode("k", t, mac=mac)
            t1 = time.perf_counter()
            codec.decode(rec, expected, mac=mac)
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
        gib = t.numel() * 4 / 2**30
        out[f"{name}_encode_ms_per_gib"] = 1e3 * statistics.median(enc) / gib
        out[f"{name}_decode_ms_per_gib"] = 1e3 * statistics.median(dec) / gib
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1664)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for the copies (0: torch's default, every core); a vLLM CPU "
                    "worker has one per core it is bound to")  # fmt: skip
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for l1_checksum in ("sampled", "full", "off"):
        r = run(args.tokens, args.repeat, l1_checksum)
        print(
            f"l1_checksum={l1_checksum:7}  {r['bytes'] / 2**20:.0f} MiB  "
            f"torch copy {r['copy_gibs']:.2f} GiB/s | L1 store {r['store_gibs']:.2f} GiB/s "
            f"({r['store_share']:.0%}) | L1 load {r['load_gibs']:.2f} GiB/s ({r['load_share']:.0%})"
        )
    c = l2_record_costs()
    print(f"L2 records ({codec.SUM_ALG} checksum), ms per GiB, encode / decode+verify:")
    for name in ("checksum", "blake2b", "blake3"):
        extra = (
            ""
            if name == "checksum"
            else f"   (MAC cost: +{c[f'{name}_encode_ms_per_gib'] - c['checksum_encode_ms_per_gib']:.0f} / "
            f"+{c[f'{name}_decode_ms_per_gib'] - c['checksum_decode_ms_per_gib']:.0f})"
        )
        print(
            f"  {name:9} {c[f'{name}_encode_ms_per_gib']:6.0f} / {c[f'{name}_decode_ms_per_gib']:6.0f}{extra}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
