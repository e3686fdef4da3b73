"""Validate + split throughput and peak memory on a large generated OpenAI Batch file.

Runs exactly what the DAG's first two tasks run (``validate_batch`` then
``split_batch`` on ``LocalStorage``, default shard size) in a child process,
and prints MB/s beside two baselines measured on the same file in the same
run: ``wc -l`` and a plain Python line-count loop. Peak RSS (the child's
VmHWM) is measured at two file sizes to show it stays flat.

    .venv/bin/python bench/validate_split.py                  # quick: 50k lines
    .venv/bin/python bench/validate_split.py --full           # 1,000,000 lines (~1 GB) + RSS at 250k

Generated files live in .work/bench/ (git-ignored) and are reused.
MB means 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = REPO / ".work" / "bench"
sys.path.insert(0, str(REPO / "plugins"))

TARGET_MB_S = 100.0
TARGET_RSS_MB = 300.0
MODEL = "tiny-llama"
ENDPOINT = "/v1/chat/completions"

_WORDS = (
    "the of and a to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water been "
    "call who oil its now find long down day did get come made may part shard merge batch token "
    "prefill decode cache vector latency throughput schedule airflow kubernetes storage request"
).split()


# ---------------------------------------------------------------------------- generation


def _line_template(rng: random.Random, approx_bytes: int) -> tuple[bytes, bytes]:
    """(prefix, suffix) of one chat request, 0.5x-1.5x ``approx_bytes``; the id goes between."""
    target = int(approx_bytes * rng.uniform(0.5, 1.5))
    sys_prompt = rng.choice(
        (
            "You are a concise assistant.",
            "You are a helpful assistant that answers in plain English.",
            "You summarise technical documents for engineers.",
        )
    )
    body = {
        "model": MODEL,
        "max_tokens": rng.choice((16, 32, 64, 128, 256)),
        "temperature": round(rng.random(), 2),
        "messages": [
            {"role": "system", "content": sys_prompt},
            {"role": "user", "content": "Summarise the following note:"},
        ],
    }
    words: list[str] = []
    overhead = len(json.dumps(body, separators=(",", ":"))) + 70
    size = overhead
    while size < target:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    body["messages"][1]["content"] += " " + " ".join(words)
    tail = json.dumps({"method": "POST", "url": ENDPOINT, "body": body}, separators=(",", ":"))
    return b'{"custom_id":"request-', b'",' + tail[1:].encode() + b"\n"


def generate(path: Path, lines: int, line_bytes: int = 1000, seed: int = 0) -> Path:
    """Write ``lines`` unique chat requests of about ``line_bytes`` each; reuse a finished file."""
    marker = path.with_suffix(path.suffix + ".done")
    if path.exists() and marker.exists() and marker.read_text().strip() == f"{lines} {line_bytes}":
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    # A pool of distinct request bodies, cycled; ids make every line unique.
    pool = [_line_template(rng, line_bytes) for _ in range(997)]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb", buffering=8 << 20) as fh:
        chunk: list[bytes] = []
        for i in range(lines):
            prefix, suffix = pool[i % 997]
            chunk.append(prefix + str(i).encode() + suffix)
            if len(chunk) == 10_000:
                fh.write(b"".join(chunk))
                chunk.clear()
        fh.write(b"".join(chunk))
    os.replace(tmp, path)
    marker.write_text(f"{lines} {line_bytes}\n")
    return path


# ---------------------------------------------------------------------------- measured work


def _vm_hwm_kib() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_validate_split(input_path: str, out_dir: str, shard_requests: int, grouping: str = "auto") -> dict:
    """validate_batch then split_batch, as the DAG's tasks call them; timings and counts.

    ``grouping`` is the DAG's ``prefix_grouping`` (auto: prefix signatures are computed)."""
    from aibrix_operators.batch.job import prefix_order_uri, split_batch, validate_batch, work_prefix
    from aibrix_operators.batch.sharding import AIRFLOW_MAX_MAP_LENGTH, DEFAULT_SHARD_BYTES
    from aibrix_operators.batch.validation import ValidationLimits
    from aibrix_operators.storage import LocalStorage

    rss_before = _vm_hwm_kib()
    storage = LocalStorage()
    limits = ValidationLimits(max_requests=100_000_000, max_file_bytes=1 << 40)
    t0, c0 = time.perf_counter(), time.process_time()
    work = work_prefix(out_dir, "manual__bench")
    report, batch = validate_batch(storage, input_path, out_dir, ENDPOINT, limits,
                                   prefix_grouping=grouping, prefix_order_uri=prefix_order_uri(work))
    t1, c1 = time.perf_counter(), time.process_time()
    if batch is None:
        raise SystemExit(f"generated file failed validation:\n{report.summary()}")
    shards = split_batch(storage, batch, work, shard_requests, DEFAULT_SHARD_BYTES, AIRFLOW_MAX_MAP_LENGTH)
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "validate_s": t1 - t0,
        "split_s": t2 - t1,
        # CPU seconds (user + system) of the child: what the shared machine's noise barely moves.
        "validate_cpu_s": c1 - c0,
        "split_cpu_s": c2 - c1,
        "requests": batch.total_requests,
        "bytes": batch.total_bytes,
        "shards": len(shards),
        "grouped": batch.prefix_order_uri is not None,
        "rss_after_import_kib": rss_before,
        "peak_rss_kib": _vm_hwm_kib(),
    }


def run_in_child(input_path: Path, out_dir: Path, shard_requests: int, profile: str | None = None,
                 grouping: str = "auto") -> dict:
    """Run the measured work in a fresh interpreter; its peak RSS is the figure reported."""
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, __file__, "--_child", str(input_path), str(out_dir), str(shard_requests),
           grouping]
    if profile:
        cmd = [sys.executable, "-m", "cProfile", "-o", profile, *cmd[1:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    _, status, rusage = os.wait4(proc.pid, 0)
    out = proc.stdout.read() if proc.stdout else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"child failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["ru_maxrss_kib"] = rusage.ru_maxrss
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------- baselines


def time_wc(path: Path) -> tuple[float, float] | None:
    """(wall, CPU) seconds of ``wc -l``."""
    if not shutil.which("wc"):
        return None
    t0 = time.perf_counter()
    before = os.times()
    subprocess.run(["wc", "-l", str(path)], check=True, stdout=subprocess.DEVNULL)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return time.perf_counter() - t0, cpu


def time_python_count(path: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of a plain Python loop over the file's lines."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    with open(path, "rb", buffering=1 << 20) as fh:
        for _ in fh:
            n += 1
    return time.perf_counter() - t0, time.process_time() - c0


# ---------------------------------------------------------------------------- report


def _mb(n: float) -> float:
    return n / 1e6


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--_child":
        print(json.dumps(run_validate_split(argv[1], argv[2], int(argv[3]), argv[4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=50_000, help="lines in the measured file (default 50k)")
    p.add_argument(
        "--rss-lines",
        type=int,
        default=None,
        help="a second, smaller file for the flat-RSS check (default lines/4)",
    )
    p.add_argument("--full", action="store_true", help="1,000,000 lines (~1 GB), RSS also at 250,000")
    p.add_argument("--line-bytes", type=int, default=1000, help="approximate bytes per line")
    p.add_argument("--shard-requests", type=int, default=5000, help="requests per shard (DAG default)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--profile", default=None, help="write a cProfile of the big run to this file")
    args = p.parse_args(argv)
    if args.full:
        args.lines = 1_000_000
    rss_lines = args.rss_lines or max(1, args.lines // 4)

    big = generate(args.workdir / f"batch-{args.lines}x{args.line_bytes}.jsonl", args.lines, args.line_bytes)
    small = generate(args.workdir / f"batch-{rss_lines}x{args.line_bytes}.jsonl", rss_lines, args.line_bytes)
    size = big.stat().st_size
    time_wc(big)  # warm the page cache so every figure reads from memory alike

    wc = time_wc(big)
    py = time_python_count(big)
    # Before/after in one run: prefix_grouping=off (no signatures) is the code before issue 12.
    res_off = run_in_child(big, args.workdir / "split-out", args.shard_requests, grouping="off")
    res = run_in_child(big, args.workdir / "split-out", args.shard_requests, args.profile)
    res_small = run_in_child(small, args.workdir / "split-out", args.shard_requests)
    both_s = res["validate_s"] + res["split_s"]
    both_mb_s = _mb(size) / both_s

    print(
        f"\nfile: {big.name}  {args.lines:,} lines, {_mb(size):,.1f} MB; "
        f"{res['shards']} shards of {args.shard_requests} requests"
    )
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}\n")
    rows = []
    if wc is not None:
        rows.append(("baseline: wc -l", *wc))
    rows.append(("baseline: python line loop", *py))
    rows += [
        ("validate_batch", res["validate_s"], res["validate_cpu_s"]),
        ("split_batch", res["split_s"], res["split_cpu_s"]),
        ("validate + split", both_s, res["validate_cpu_s"] + res["split_cpu_s"]),
        ("  same, prefix_grouping=off", res_off["validate_s"] + res_off["split_s"],
         res_off["validate_cpu_s"] + res_off["split_cpu_s"]),
    ]
    ref = (wc or py)[0]
    mb = _mb(size)
    print(
        f"{'step':<28}{'seconds':>9}{'MB/s':>9}{'vs wc -l' if wc else 'vs py loop':>11}"
        f"{'CPU s':>8}{'MB/CPU-s':>10}"
    )
    for label, secs, cpu in rows:
        print(
            f"{label:<28}{secs:>9.2f}{mb / secs:>9.1f}{ref / secs:>10.3f}x"
            f"{cpu:>8.2f}{mb / max(cpu, 1e-3):>10.1f}"
        )
    ok_speed = both_mb_s >= TARGET_MB_S
    print(
        f"\ntarget validate+split >= {TARGET_MB_S:.0f} MB/s: {both_mb_s:.1f} MB/s "
        f"-> {'PASS' if ok_speed else 'MISS'}"
    )

    print(f"\n{'peak RSS (child VmHWM)':<28}{'lines':>11}{'MB file':>10}{'peak MB':>10}{'imports MB':>12}")
    for r, n in ((res_small, rss_lines), (res, args.lines)):
        print(
            f"{'validate + split':<28}{n:>11,}{_mb(r['bytes']):>10.1f}"
            f"{r['peak_rss_kib'] / 1024:>10.1f}{r['rss_after_import_kib'] / 1024:>12.1f}"
        )
    print(f"{'  same, prefix_grouping=off':<28}{args.lines:>11,}{_mb(res_off['bytes']):>10.1f}"
          f"{res_off['peak_rss_kib'] / 1024:>10.1f}{res_off['rss_after_import_kib'] / 1024:>12.1f}")
    print(f"grouping applied (auto): {res['grouped']}")
    peak = max(res["peak_rss_kib"], res_small["peak_rss_kib"]) / 1024
    growth = (res["peak_rss_kib"] - res_small["peak_rss_kib"]) / 1024
    print(
        f"\ntarget peak RSS < {TARGET_RSS_MB:.0f} MB: {peak:.1f} MB -> "
        f"{'PASS' if peak < TARGET_RSS_MB else 'MISS'}; growth from {rss_lines:,} to "
        f"{args.lines:,} lines: {growth:+.1f} MB "
        f"({growth * 1e6 / max(1, args.lines - rss_lines) * 1.048576:.1f} bytes/request)"
    )
    return 0 if ok_speed and peak < TARGET_RSS_MB else 1


if __name__ == "__main__":
    sys.exit(main())
