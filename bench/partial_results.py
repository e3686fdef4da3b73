"""Partial results (issue 39): how fast the api-server streams a running batch's finished shards'
answers (``batch/partial.py``, what ``GET /v1/files/{partial id}/content`` sends), and how much
it holds while doing so.

The shards' result logs are written by the driver's own writer (``ResultLog``) into a local
folder: ``--shards`` shards of ``--per-shard`` answers of ~``--line-bytes`` bytes each, a segment
per 1,000 answers (the driver's flush size), answered out of order as a driver's would be. Then,
each in a child process of its own (its peak RSS is its own ``ru_maxrss``):

  raw       read every segment's bytes and write them out (the floor: what any reader pays)
  partial   ``partial_answers`` over every shard: parse, first answer per request, input order

MB/s is bytes out over wall time; the target is >= 100 MB/s with memory flat in the output's
size (a run with twice the shards must not need more memory).

    .venv/bin/python bench/partial_results.py                  # ~1 GB of answers
    .venv/bin/python bench/partial_results.py --shards 2 --per-shard 20000
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))

from aibrix_operators.batch.partial import partial_answers  # noqa: E402
from aibrix_operators.batch.shard_results import ResultLog, fingerprint_shard, results_prefix  # noqa: E402
from aibrix_operators.batch.sharding import ShardSpec  # noqa: E402
from aibrix_operators.storage import LocalStorage  # noqa: E402


def binding_of(storage: LocalStorage, spec: ShardSpec) -> str:
    return fingerprint_shard(storage, spec.uri).binding


def write_batch(root: Path, shards: int, per_shard: int, line_bytes: int) -> list[ShardSpec]:
    storage, work = LocalStorage(), str(root / "work")
    specs, rng = [], random.Random(7)
    for index in range(shards):
        ids = [f"req-{index:03d}-{i:07d}" for i in range(per_shard)]
        uri = str(root / f"shard-{index}.jsonl")
        storage.write_bytes(uri, b"".join(b'{"custom_id": "%s", "body": {}}\n' % c.encode() for c in ids))
        spec = ShardSpec(index=index, uri=uri, first_line=1 + index * per_shard, num_requests=per_shard,
                         num_bytes=0)
        log = ResultLog(storage, results_prefix(work, spec.name), binding_of(storage, spec),
                        flush_every=1000, attempt_id="0001")
        order = list(range(per_shard))
        for start in range(0, per_shard, 64):  # answers come back about in send order, not in it
            window = order[start:start + 64]
            rng.shuffle(window)
            order[start:start + 64] = window
        for i in order:
            head = {"id": f"r{i}", "custom_id": ids[i], "error": None,
                    "response": {"status_code": 200, "request_id": f"q{i}",
                                 "body": {"usage": {"prompt_tokens": 9, "completion_tokens": 8}, "pad": ""}}}
            line = json.dumps(head)
            head["response"]["body"]["pad"] = "x" * max(0, line_bytes - len(line))
            log.append(json.dumps(head).encode())
            if log.due():
                log.flush()
        log.flush()
        specs.append(spec)
    return specs


def run_phase(phase: str, root: Path, shards: int) -> dict:
    storage, work = LocalStorage(), str(root / "work")
    specs = [ShardSpec.from_dict(s) for s in json.loads((root / "shards.json").read_text())][:shards]
    out = open("/dev/null", "wb")
    start = time.perf_counter()
    written = 0
    if phase == "raw":
        for spec in specs:
            log = ResultLog(storage, results_prefix(work, spec.name), binding_of(storage, spec))
            for uri in log.segments():
                data = storage.read_bytes(uri)
                out.write(data)
                written += len(data)
    else:
        for chunk in partial_answers(storage, specs, range(len(specs)), work):
            out.write(chunk)
            written += len(chunk)
    wall = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"phase": phase, "shards": len(specs), "bytes": written, "wall_s": round(wall, 3),
            "mb_s": round(written / wall / 1e6, 1), "peak_rss_mb": round(peak_mb, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=250_000)
    parser.add_argument("--line-bytes", type=int, default=500)
    parser.add_argument("--phase", choices=("raw", "partial"), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--use-shards", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, Path(args.root), args.use_shards)))
        return
    with tempfile.TemporaryDirectory(prefix="partial-bench-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        specs = write_batch(root, args.shards, args.per_shard, args.line_bytes)
        (root / "shards.json").write_text(json.dumps([s.as_dict() for s in specs]))
        rows = []
        for use in (args.shards // 2, args.shards):
            for phase in ("raw", "partial"):
                proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--root", str(root),
                                       "--use-shards", str(use)], capture_output=True, text=True, check=True)
                rows.append(json.loads(proc.stdout))
                print(json.dumps(rows[-1]), flush=True)
        print("| shards | output | raw MB/s | partial MB/s | partial / raw | partial peak RSS |")
        print("|---|---|---|---|---|---|")
        for raw, part in zip(rows[::2], rows[1::2], strict=True):
            print(f"| {part['shards']} | {part['bytes'] / 1e6:.0f} MB | {raw['mb_s']} | {part['mb_s']} | "
                  f"{part['mb_s'] / raw['mb_s']:.2f} | {part['peak_rss_mb']} MB |")


if __name__ == "__main__":
    main()
