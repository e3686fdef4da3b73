"""Run one shard of an OpenAI batch against an OpenAI-compatible server (the driver pod's entry point).

    python -m aibrix_operators.driver.cli \\
        --shard-uri s3://bucket/run/shards/shard-00000.jsonl \\
        --results-prefix s3://bucket/run/results/shard-00000 --endpoint http://router:8000

Each request of the shard ends exactly once in the result log under --results-prefix, as
a success or as an error that belongs to the request. Re-running the same command
resumes: answered requests are skipped. The last line on stdout is the shard outcome as
JSON; logs go to stderr.

environment:
  OPENAI_API_KEY          API key sent as "Authorization: Bearer ..." (the variable's name
                          is --api-key-env); sent only if --endpoint is OPENAI_API_KEY_ORIGIN
                          (or --api-key-origin: scheme://host:port, optionally with a base
                          path) or below its path, so a mistyped --endpoint never receives
                          it. Mount the key from a
                          Kubernetes Secret; it is never a flag.
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION
                          credentials and endpoint for s3:// URIs (boto3's usual variables).
  AIBRIX_DRIVER_METRICS_PORT, AIBRIX_DRIVER_METRICS_ADDR
                          serve Prometheus /metrics there while the shard runs (address
                          default 127.0.0.1; a driver pod sets 0.0.0.0 and declares the port)
  AIBRIX_PUSHGATEWAY_URL  push the final totals there when the shard ends

exit codes:
  0   every request answered successfully
  1   finished; some requests ended as error lines of their own (see the result log;
      a re-run of a finished shard sends nothing and exits with the same code)
  2   bad arguments
  3   the endpoint is unavailable (not up in --endpoint-wait, or an outage longer than
      --outage-budget); unanswered requests were not recorded: re-run to send them
  4   the endpoint does not serve the batch's model (re-running will not help)
  5   storage failed (reading the shard or writing checkpoints); re-run to resume
  6   the shard changed after it was planned (re-split the batch)
  70  unexpected internal error (a bug: please report it with the log)
  143 terminated by SIGTERM (a pod deletion); answers checkpointed so far are kept: re-run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.checkpoint import CheckpointWriteFailed
from aibrix_operators.driver.config import DEFAULT_ENDPOINT_WAIT_S, DriverConfig
from aibrix_operators.driver.health import EndpointOutage
from aibrix_operators.driver.preflight import EndpointUnavailable, ModelNotServed, check_endpoint
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.driver.shard_outcome import ShardChanged, ShardOutcome
from aibrix_operators.storage import StorageError, storage_for

EXIT_OK = 0
EXIT_REQUEST_ERRORS = 1
EXIT_USAGE = 2
EXIT_ENDPOINT_UNAVAILABLE = 3
EXIT_MODEL_NOT_SERVED = 4
EXIT_STORAGE = 5
EXIT_SHARD_CHANGED = 6
EXIT_INTERNAL = 70
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell or a kubelet reports for SIGTERM

_EXIT_FOR: list[tuple[type[BaseException], int]] = [
    (EndpointUnavailable, EXIT_ENDPOINT_UNAVAILABLE),
    (EndpointOutage, EXIT_ENDPOINT_UNAVAILABLE),
    (ModelNotServed, EXIT_MODEL_NOT_SERVED),
    (CheckpointWriteFailed, EXIT_STORAGE),
    (StorageError, EXIT_STORAGE),
    (ShardChanged, EXIT_SHARD_CHANGED),
]

log = logging.getLogger("aibrix_operators.driver.cli")


def build_parser() -> argparse.ArgumentParser:
    d = DriverConfig("http://placeholder")  # the defaults, documented once
    p = argparse.ArgumentParser(
        prog="python -m aibrix_operators.driver.cli", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_argument_group("what to run")
    where.add_argument("--shard-uri", required=True, metavar="URI",
                       help="the shard's JSONL file: a local path or s3://bucket/key")
    where.add_argument("--results-prefix", required=True, metavar="URI",
                       help="where the shard's result segments go (local directory or s3:// prefix)")
    where.add_argument("--endpoint", default=None, metavar="URL",
                       help="base URL of the OpenAI-compatible server, e.g. http://router:8000 "
                            "(required unless --config-json gives it)")
    where.add_argument("--config-json", default=None, metavar="JSON",
                       help="the whole driver config as the Airflow worker made it (what a driver pod "
                            "gets: DriverConfig.to_json); the sending, outage and window flags then "
                            "may not be given too")
    where.add_argument("--model", default=None,
                       help="the batch's model: the preflight fails at once (exit 4) if the server "
                            "does not list it")
    where.add_argument("--total", type=int, default=None, metavar="N",
                       help="requests the shard was planned with; a shard holding another count is "
                            "refused (exit 6)")
    where.add_argument("--deadline", type=float, default=None, metavar="UNIX_TIME",
                       help="end of the completion window (seconds since the epoch); unanswered "
                            "requests end as batch_expired after it")
    where.add_argument("--cancel-uri", default=None, metavar="URI",
                       help="cancel marker: once an object exists here, no request starts and the "
                            "unanswered ones end as batch_cancelled (the shard still finishes)")
    where.add_argument("--api-key-env", default=d.api_key_env, metavar="NAME",
                       help="environment variable holding the API key (default: %(default)s)")
    where.add_argument("--api-key-origin", default=None, metavar="ORIGIN",
                       help="scheme://host:port[/base] the key belongs to; it is sent only when "
                            "--endpoint is that URL or below its path (default: the NAME_ORIGIN "
                            "environment variable)")

    send = p.add_argument_group("sending")
    send.add_argument("--cache-salt", default=None, metavar="SALT",
                      help="vLLM cache_salt for every chat/completions request; a line's own is "
                           "kept under it (SALT:own). Requests share cached prefixes only with "
                           "the same salt (the Batch API sets one per tenant)")
    send.add_argument("--shared-capacity", default=None, metavar="JSON",
                      help="shared capacity mode: the endpoint also serves online traffic; requests "
                           "carry the batch priority and an adaptive limit (at most --concurrency) "
                           "paces them. JSON of the deployment's settings (docs/shared-capacity.md)")
    send.add_argument("--concurrency", type=int, default=d.concurrency, metavar="N",
                      help="requests in flight (default: %(default)s)")
    send.add_argument("--max-attempts", type=int, default=d.max_attempts, metavar="N",
                      help="attempts per request on 5xx, timeouts and dropped connections while the "
                           "server answers others (default: %(default)s)")
    send.add_argument("--request-timeout", type=float, default=d.request_timeout_s, metavar="SECONDS",
                      help="per attempt, whole request (default: %(default)s)")
    send.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, metavar="SECONDS",
                      help="per connection attempt (default: %(default)s)")
    send.add_argument("--backoff-base", type=float, default=d.backoff_base_s, metavar="SECONDS",
                      help="first retry waits up to this, doubling per attempt (default: %(default)s)")
    send.add_argument("--backoff-max", type=float, default=d.backoff_max_s, metavar="SECONDS",
                      help="longest wait between attempts (default: %(default)s)")

    outage = p.add_argument_group("endpoint outages")
    outage.add_argument("--endpoint-wait", type=float, default=DEFAULT_ENDPOINT_WAIT_S, metavar="SECONDS",
                        help="preflight: wait this long for a starting server (default: %(default)s)")
    outage.add_argument("--skip-preflight", action="store_true",
                        help="send without checking the endpoint and model first")
    outage.add_argument("--breaker-failures", type=int, default=d.breaker_failures, metavar="N",
                        help="failures in a row that pause all sending (default: %(default)s)")
    outage.add_argument("--probe-interval", type=float, default=d.probe_interval_s, metavar="SECONDS",
                        help="health check interval while paused (default: %(default)s)")
    outage.add_argument("--outage-budget", type=float, default=d.outage_budget_s, metavar="SECONDS",
                        help="give up (exit 3) when the endpoint answers nothing this long "
                             "(default: %(default)s)")

    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--flush-interval", type=float, default=d.flush_interval_s, metavar="SECONDS",
                      help="answers are made durable at least this often: what a kill can cost "
                           "(default: %(default)s)")
    ckpt.add_argument("--flush-every", type=int, default=d.flush_every, metavar="N",
                      help="or every N answers, whichever comes first (default: %(default)s)")
    ckpt.add_argument("--checkpoint-retry", type=float, default=d.checkpoint_retry_s, metavar="SECONDS",
                      help="retry a failing store this long before giving up (exit 5) "
                           "(default: %(default)s)")
    ckpt.add_argument("--max-unflushed", type=int, default=d.max_unflushed, metavar="N",
                      help="pause sending while this many answers wait for the store "
                           "(default: %(default)s)")
    p.add_argument("--progress-interval", type=float, default=d.progress_interval_s, metavar="SECONDS",
                   help="progress line interval on stderr (default: %(default)s)")
    return p


# The flags a --config-json run takes from the JSON instead (argparse dest names).
_CONFIG_FLAGS = ("endpoint", "concurrency", "max_attempts", "request_timeout", "connect_timeout",
                 "backoff_base", "backoff_max", "flush_interval", "flush_every", "progress_interval",
                 "deadline", "api_key_env", "api_key_origin", "breaker_failures", "probe_interval",
                 "outage_budget", "checkpoint_retry", "max_unflushed", "cancel_uri", "cache_salt",
                 "shared_capacity")


def config_from(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> DriverConfig:
    """The run's DriverConfig: the pod's ``--config-json`` (one serialisation, checked here as the
    worker checked it), or the flags a person gives."""
    if args.config_json is not None:
        defaults = build_parser() if parser is None else parser
        given = [f"--{n.replace('_', '-')}" for n in _CONFIG_FLAGS
                 if getattr(args, n) != defaults.get_default(n)]
        if given:
            raise ValueError(f"--config-json carries the whole config; do not give {', '.join(given)} too")
        return DriverConfig.from_json(args.config_json)
    if args.endpoint is None:
        raise ValueError("give --endpoint (the OpenAI-compatible server's base URL) or --config-json")
    return DriverConfig(
        endpoint=args.endpoint, concurrency=args.concurrency, max_attempts=args.max_attempts,
        request_timeout_s=args.request_timeout, connect_timeout_s=args.connect_timeout,
        backoff_base_s=args.backoff_base, backoff_max_s=args.backoff_max,
        flush_interval_s=args.flush_interval, flush_every=args.flush_every,
        progress_interval_s=args.progress_interval, deadline=args.deadline,
        api_key_env=args.api_key_env or None, api_key_origin=args.api_key_origin,
        breaker_failures=args.breaker_failures,
        probe_interval_s=args.probe_interval, outage_budget_s=args.outage_budget,
        checkpoint_retry_s=args.checkpoint_retry, max_unflushed=args.max_unflushed,
        cancel_uri=args.cancel_uri, cache_salt=args.cache_salt or None,
        capacity=SharedCapacity.from_json(args.shared_capacity) if args.shared_capacity else None,
    )


async def _run(args: argparse.Namespace, config: DriverConfig) -> ShardOutcome:
    if not args.skip_preflight:
        await check_endpoint(config, args.model, args.endpoint_wait)
    storage = storage_for(args.shard_uri)
    return await run_shard(storage, args.shard_uri, args.results_prefix, config, total=args.total)


def exit_code_for(outcome: dict[str, Any]) -> int:
    # Counted over the whole result log, so re-running a finished shard gives the same code.
    return EXIT_REQUEST_ERRORS if outcome["failed"] or outcome["resumed_failed"] else EXIT_OK


class Terminated(KeyboardInterrupt):
    """SIGTERM: the pod is being deleted (or the node drained)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    # In a container the driver is PID 1, for which the kernel ignores SIGTERM unless a handler
    # is installed: without this a pod deletion would wait out its whole grace period.
    signal.signal(signal.SIGTERM, _terminate)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        config = config_from(args, parser)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line
    try:
        outcome = asyncio.run(_run(args, config)).as_dict()
    except Terminated:
        log.error("terminated (SIGTERM); answers checkpointed so far are kept, re-run to resume")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        log.error("interrupted; answers checkpointed so far are kept, re-run to resume")
        return 130
    except Exception as exc:  # noqa: BLE001 - mapped to a one-line message and an exit code
        for kind, code in _EXIT_FOR:
            if isinstance(exc, kind):
                log.error("%s", exc)
                return code
        log.exception("internal error (a bug; please report it with this log): %s", exc)
        return EXIT_INTERNAL
    sys.stdout.write(json.dumps(outcome) + "\n")
    code = exit_code_for(outcome)
    if code:
        failed = outcome["failed"] + outcome["resumed_failed"]
        log.warning("%d of %d requests ended as error lines of their own", failed, outcome["total"])
    return code


if __name__ == "__main__":
    sys.exit(main())
