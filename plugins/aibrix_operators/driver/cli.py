"""Command-line entry point of the driver image: run one shard.

    python -m aibrix_operators.driver.cli --shard-uri s3://b/run/shards/shard-00000.jsonl \
        --results-prefix s3://b/run/results/shard-00000 --endpoint http://router:8000

Prints the shard outcome as one JSON line on stdout (the last line), which the
Kubernetes dispatch path reads back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import storage_for


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aibrix_operators.driver.cli", description=__doc__)
    p.add_argument("--shard-uri", required=True)
    p.add_argument("--results-prefix", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--deadline", type=float, default=None, help="unix time; no request starts after it")
    p.add_argument("--total", type=int, default=None)
    p.add_argument("--progress-interval", type=float, default=10.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = DriverConfig(
        endpoint=args.endpoint, concurrency=args.concurrency, max_attempts=args.max_attempts,
        request_timeout_s=args.request_timeout, deadline=args.deadline,
        progress_interval_s=args.progress_interval,
    )
    storage = storage_for(args.shard_uri)
    outcome = asyncio.run(
        run_shard(storage, args.shard_uri, args.results_prefix, config, total=args.total)
    )
    sys.stdout.write(json.dumps(outcome.as_dict()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
