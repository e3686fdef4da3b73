"""``validate_stream``'s CPU time, this tree against another checkout's, alternating in fresh processes.

A change to validation's per-line loop is measured here in CPU seconds (``time.process_time`` of
the child, immune to what else the machine runs), the same generated file for both trees:

    git worktree add /tmp/base HEAD~3
    .venv/bin/python bench/validate_pair.py --other /tmp/base/plugins --lines 300000 --pairs 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from aibrix_operators.batch.validation import ValidationLimits, validate_stream
limits = ValidationLimits(max_requests=10**9, max_file_bytes=10**12)
path = sys.argv[2]
started = time.process_time()
with open(path, "rb") as f:
    report = validate_stream(f, None, limits, reopen=lambda: open(path, "rb"))
assert report.ok, report.summary()
print(time.process_time() - started)
"""


def cpu_seconds(plugins: Path, path: Path) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(plugins), str(path)], check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", required=True, type=Path, help="the other checkout's plugins/ folder")
    p.add_argument("--lines", type=int, default=300_000)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    from validate_split import DEFAULT_WORKDIR, generate

    path = generate(DEFAULT_WORKDIR / f"pair-{args.lines}.jsonl", args.lines, line_bytes=1000)
    this, other = [], []
    for _ in range(args.pairs):
        other.append(cpu_seconds(args.other, path))
        this.append(cpu_seconds(REPO / "plugins", path))
    print(f"{path.stat().st_size / 1e6:.1f} MB, {args.lines} lines; CPU s: this {this}, other {other}")
    print(f"this / other (medians): {sorted(this)[len(this) // 2] / sorted(other)[len(other) // 2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
