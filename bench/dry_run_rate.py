"""A dry run's pass over a big batch file: MB/s and peak RSS (issue 40: "1 GB at >= 100 MB/s, flat
memory").

Two passes, each in a fresh process over the same generated chat file:
- ``client``: what ``aibrix-batch create --dry-run`` runs before its one small POST (the client's
  local check, ``client.batch_client.checked_report``: every line validated, the work counted);
- ``dag``: what the DAG's validate task runs for ``dry_run`` with the deployment's tokenizer
  (``validate_stream`` with ``PromptCounter``: every request of the first 8 MiB tokenized, then 1 in
  100, batch/prompt_tokens.py);
- ``--exact`` adds ``dag-exact`` (every request tokenized), the reference the sampled count is
  compared with (slow: about 4 MB/s a core).

    .venv/bin/python bench/dry_run_rate.py --mb 1024 --tokenizer .work/models/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import json, resource, sys, time
mode, path, tokenizer = sys.argv[1:4]
from aibrix_operators.batch.validation import ValidationLimits, validate_stream
from aibrix_operators.batch.prompt_tokens import PromptCounter
from aibrix_operators.client.batch_client import checked_report
wall, cpu = time.monotonic(), time.process_time()
if mode == "client":
    report = checked_report(path, None)
else:
    exact = 2**62 if mode == "dag-exact" else None
    counter = (PromptCounter({"m": tokenizer}) if exact is None
               else PromptCounter({"m": tokenizer}, exact_bytes=exact))
    limits = ValidationLimits(max_requests=10**9, max_file_bytes=10**12)
    with open(path, "rb") as f:
        report = validate_stream(f, None, limits, reopen=lambda: open(path, "rb"), count_tokens=counter)
assert report.ok, report.summary()
print(json.dumps({"wall_s": time.monotonic() - wall, "cpu_s": time.process_time() - cpu,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "requests": report.total_requests, "input_tokens": report.input_tokens}))
"""

WORDS = ("the quick brown fox jumps over a lazy dog while the nightly evaluation reads batch inference "
         "results written by workers at midnight summarise translate classify answer briefly").split()


def generate(path: Path, megabytes: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    target, written, i = megabytes * 10**6, 0, 0
    with path.open("w") as f:
        while written < target:
            text = " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))
            line = json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "max_tokens": 64,
                                        "messages": [{"role": "user", "content": text}]}}) + "\n"
            f.write(line)
            written += len(line)
            i += 1


def run(mode: str, path: Path, tokenizer: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "plugins")}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), tokenizer], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=1024, help="the generated file's size, in MB")
    p.add_argument("--tokenizer", default=str(REPO / ".work/models/tiny-llama"),
                   help="a Hugging Face model directory (make_model.py's tiny model by default)")
    p.add_argument("--exact", action="store_true", help="also count every request (the reference)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        path = Path(tmp) / "batch.jsonl"
        generate(path, args.mb)
        size_mb = path.stat().st_size / 10**6
        modes = ["client", "dag"] + (["dag-exact"] if args.exact else [])
        results = {mode: run(mode, path, args.tokenizer) for mode in modes}
    print(f"file: {size_mb:.0f} MB, {results['client']['requests']} requests")
    for mode, r in results.items():
        print(f"{mode:10s} {size_mb / r['wall_s']:7.1f} MB/s wall  {size_mb / r['cpu_s']:7.1f} MB/cpu-s  "
              f"peak RSS {r['peak_rss_mb']:6.1f} MB  input_tokens {r['input_tokens']}")
    if args.exact:
        sampled, exact = results["dag"]["input_tokens"], results["dag-exact"]["input_tokens"]
        print(f"sampled count / exact count: {sampled / exact:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
