"""Every GPU figure the KV-cache connector still owes, in one command.

    python3 bench/device_check.py OUT_DIR [--baseline DIR]             # on a GPU: 8b and 70b
    python3 bench/device_check.py OUT_DIR --device cpu --preset small  # what the tests run

For each preset it runs ``bench/gpu_kvcache.py`` (the connector's worker driven by a synthetic
per-layer forward, full L1 check as deployed) once for this tree and, with ``--baseline``, once
for the ``kvcache`` package in ``DIR`` (an earlier tree: ``git archive REV kvcache | tar -x -C
DIR``, and REV in ``DIR/REV`` to name it in the table), alternating, each in its own process;
then the L2 read path's host-side cost (decoding and checking one layer-record of a chunk, per
host thread). It writes ``device_check.json`` and ``device_check.md`` (the table
``bench/RESULTS.md`` keeps) to ``OUT_DIR`` and prints the table.

Targets (issue 41): saves and loads each >= 80 % hidden behind compute at 8b and 70b; the whole
check under 8 minutes on one H100 or H200, so it can run twice in a session's 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_BENCH = REPO / "bench" / "gpu_kvcache.py"
TARGET_HIDDEN = 0.80


def run_bench(tree: Path | None, device: str, preset: str, steps: int, timeout_s: float) -> dict:
    """One ``gpu_kvcache.py`` run in its own process (one tree's ``kvcache`` imported)."""
    env = dict(os.environ)
    if tree is not None:
        env["AIBRIX_KVCACHE_TREE"] = str(tree)
    cmd = [sys.executable, str(GPU_BENCH), "--device", device, "--preset", preset, "--steps", str(steps),
           "--l1-checksum", "full", "--json"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} (tree {tree or 'this'}) exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return {**json.loads(line), "wall_s": round(time.monotonic() - t0, 1)}


def l2_read_cost(preset: str, records: int = 64) -> dict:
    """Host-side cost of the L2 read path for one layer of one chunk: ``codec.decode`` with its
    checksum pass (what ``fetch_l2`` does after the tier's get), in GB/s of one host thread."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_kvcache
    import torch

    from kvcache import codec

    s = gpu_kvcache.PRESETS[preset]
    chunk_tokens = 128
    shape = (chunk_tokens // s.block, 2, s.block, s.kv_heads, s.head_dim)
    expected = codec.Expected("k", torch.bfloat16, shape)
    payloads = [torch.randn(shape).to(torch.bfloat16) for _ in range(8)]
    blobs = [codec.encode("k", p) for p in payloads]
    for blob in blobs:  # warm-up, and the round trip is exact
        out, _ = codec.decode(blob, expected)
    assert torch.equal(out, payloads[-1])
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(records):
            codec.decode(blobs[i % len(blobs)], expected)
        times.append(time.perf_counter() - t0)
    per = statistics.median(times) / records
    nbytes = payloads[0].numel() * payloads[0].element_size()
    return {"record_bytes": nbytes, "decode_us": round(per * 1e6, 1),
            "decode_gbps": round(nbytes / per / 1e9, 2)}


def table(results: list[dict], l2: dict, device_name: str) -> str:
    lines = [
        f"Device: {device_name}. ms per step, median of the bench's steps; hidden = (sync - pipelined) "
        f"/ (sync - compute), target >= {TARGET_HIDDEN:.0%}.",
        "",
        "| preset | tree | save: compute / sync / pipelined | save hidden | load: compute / sync / pipelined "
        "| load hidden | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = []
        for op in ("save", "load"):
            ms = " / ".join(f"{r[f'{op}_{m}_s'] * 1e3:.1f}" for m in ("compute", "sync", "pipelined"))
            cells += [ms, f"{r[f'{op}_hidden_frac']:.0%}"]
        lines.append(f"| {r['preset']} | {r['tree']} | {' | '.join(cells)} | {r['wall_s']:.0f} s |")
    kib = l2["record_bytes"] >> 10
    lines += ["", f"L2 read path, host side (one thread): decode + checksum of a {kib} KiB layer-record "
                  f"{l2['decode_us']} µs, {l2['decode_gbps']} GB/s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--preset", action="append", help="repeatable; default 8b and 70b on cuda, small on cpu")
    ap.add_argument("--baseline", type=Path, help="a folder holding an earlier tree's kvcache package")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per bench process")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    presets = args.preset or (["8b", "70b"] if device.startswith("cuda") else ["small"])
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    if args.baseline is not None and not (args.baseline / "kvcache" / "__init__.py").exists():
        raise SystemExit(f"--baseline {args.baseline}: no kvcache package there "
                         "(make one: git archive REV kvcache | tar -x -C DIR)")
    t0 = time.monotonic()
    trees: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline is not None:
        rev = args.baseline / "REV"  # the commit it was archived from, when written beside it
        label = rev.read_text().strip() if rev.exists() else args.baseline.name
        trees.append((f"{label} (baseline)", args.baseline.resolve()))
    results = []
    for preset in presets:
        for name, tree in trees:  # alternating trees per preset: drift hits both
            r = run_bench(tree, device, preset, args.steps, args.timeout_s)
            results.append({**r, "tree": name})
            print(f"{preset} {name}: save hidden {r['save_hidden_frac']:.0%}, load hidden "
                  f"{r['load_hidden_frac']:.0%} ({r['wall_s']:.0f} s)", flush=True)
    l2 = l2_read_cost(presets[0])
    out = {"device": device_name, "torch": torch.__version__, "presets": presets, "runs": results,
           "l2_read": l2, "wall_s": round(time.monotonic() - t0, 1),
           "met": all(r["save_hidden_frac"] >= TARGET_HIDDEN and r["load_hidden_frac"] >= TARGET_HIDDEN
                      for r in results if r["tree"] == "this")}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "device_check.json").write_text(json.dumps(out, indent=1) + "\n")
    md = table(results, l2, device_name) + f"\n\nWhole check: {out['wall_s']:.0f} s.\n"
    (args.out_dir / "device_check.md").write_text(md)
    print(md)
    return out


if __name__ == "__main__":
    main()
