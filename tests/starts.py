"""Count the expensive processes the suite starts: vLLM servers, Airflow stacks, ``dags test`` runs.

Every process a pytest process starts raises the ``subprocess.Popen`` audit event; this hook
classifies those by their command line and, at the session's end, writes the counts of this
process (an xdist worker, or the only one) to ``.work/test-starts/<worker>.json``.
``python -m tests.starts`` sums the files and prints the table ``make test`` ends with
(docs/testing.md keeps the counts before and after the suite's sharing work). Processes started
by those processes (a bench script's own server) are not seen; they are counted where the bench
says so. ``dags test`` runs forked by tests/integration/dags_test_server.py start no process here:
conftest.DagsTestServers counts each.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / ".work" / "test-starts"
KINDS = ("vllm_servers", "airflow_stacks", "dags_test_runs", "other_processes")


def kind_of(args: Any) -> str:
    argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else [os.fsdecode(args)]
    line = " ".join(argv)
    if "vllm.entrypoints.openai.api_server" in line:
        return "vllm_servers"
    if len(argv) >= 2 and Path(argv[0]).name == "airflow" and argv[1] == "scheduler":
        return "airflow_stacks"  # one scheduler per stack: api-server, dag-processor, triggerer beside it
    if len(argv) >= 3 and Path(argv[0]).name == "airflow" and argv[1:3] == ["dags", "test"]:
        return "dags_test_runs"
    return "other_processes"


class StartCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "subprocess.Popen" and len(args) > 1 and args[1] is not None:
            self.counts[kind_of(args[1])] += 1

    def write(self, worker: str) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{worker}-{os.getpid()}.json").write_text(json.dumps(dict(self.counts)))


COUNTER = StartCounter()


def install() -> None:
    sys.addaudithook(COUNTER.audit)


def reset() -> None:
    """Before a `make test`: forget the counts of an earlier run."""
    for old in OUT.glob("*.json") if OUT.exists() else ():
        old.unlink()


def total() -> Counter[str]:
    summed: Counter[str] = Counter()
    for path in OUT.glob("*.json") if OUT.exists() else ():
        summed.update(json.loads(path.read_text()))
    return summed


if __name__ == "__main__":
    if sys.argv[1:] == ["reset"]:
        reset()
    else:
        counts = total()
        print("processes the suite started: " + ", ".join(f"{k.replace('_', ' ')} {counts.get(k, 0)}"
                                                           for k in KINDS))
