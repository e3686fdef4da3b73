"""Command line of the router (also the image's entrypoint).

Instances come from flags or environment (comma-separated), or from DNS: a headless
Service's A records are the role's pods (refreshed every health interval).

    python -m aibrix_operators.router --port 8000 \\
        --prefill http://10.0.0.5:8000#set-0 --decode http://10.0.0.6:8000#set-0
    ROUTER_PREFILL_DNS=prefill.ns.svc:8000 ROUTER_DECODE_DNS=decode.ns.svc:8000 \\
        python -m aibrix_operators.router
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aibrix_operators.lora.registry import AdapterRegistryError, load_registry

from . import serve
from .admin import AdminConfigError, AdminPolicy, read_token
from .admission import Admission
from .affinity import DEFAULT_ENTRIES, DEFAULT_SLACK
from .app import build_app
from .backends import DECODE, PREFILL, parse_backend


def _list(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v.strip()]


def _option(p: argparse.ArgumentParser, flag: str, default: str | None = None, **kw) -> None:
    """``flag``, defaulting to the environment's ``ROUTER_<FLAG>`` (the image's way in), else to
    ``default``. A string default goes through the option's ``type`` as if given on the command
    line, so a bad environment value is refused the way a bad flag is."""
    name = "ROUTER_" + flag.removeprefix("--").upper().replace("-", "_")
    p.add_argument(flag, default=os.environ.get(name) or default, **kw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    _option(p, "--host", "0.0.0.0")
    _option(p, "--port", "8000", type=int)
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}", action="append", default=_list(env(f"ROUTER_{role.upper()}")),
                       help=f"{role} instance URL[#pod-set]; repeatable (env ROUTER_{role.upper()}, "
                       "comma-separated)")
        _option(p, f"--{role}-dns", help=f"HOST:PORT of {role}'s headless Service")
    _option(p, "--health-interval-s", "1.0", type=float,
            help="seconds between health and load scrapes of every instance")
    _option(p, "--request-timeout-s", "600", type=float, help="seconds one upstream call may take")
    _option(p, "--idle-timeout-s", "30", type=float,
            help="seconds a client connection may go without a complete request before it is closed: "
            "idle keep-alive connections and half-sent headers alike (default: %(default)s)")
    _option(p, "--body-timeout-s", "30", type=float,
            help="seconds a request body may take to arrive; slower is answered 408 and the connection "
            "closed (default: %(default)s)")
    _option(p, "--shutdown-timeout-s", "20", type=float,
            help="on SIGTERM, seconds requests in flight get to finish (the batch driver retries the rest)")
    _option(p, "--prefix-affinity", "on", choices=("on", "off"),
            help="send requests with the same prompt prefix to the instance that took it last, unless it "
            "is busier than the least-loaded by more than --affinity-slack (default: on)")
    _option(p, "--affinity-slack", str(DEFAULT_SLACK), type=float,
            help="load score (about one running request per unit) an instance holding the prefix may "
            "carry above the least-loaded one and still be chosen (default: %(default)s)")
    _option(p, "--affinity-entries", str(DEFAULT_ENTRIES), type=int,
            help="prefix blocks (512 bytes of prompt each) remembered per role, least recently used "
            "dropped first (default: %(default)s)")
    _option(p, "--max-connections", "4096", type=int,
            help="open client connections at most; past it a new one is answered 503 and closed, so one "
            "client cannot hold every socket (default: %(default)s)")
    _option(p, "--online-first", "0", type=int, metavar="N",
            help="forward at most N requests at once; when full, online requests go first and batch ones "
            "are answered 429 (the batch driver retries them). 0: off, every request forwarded at once "
            "(docs/shared-capacity.md)")
    _option(p, "--batch-queue", "256", type=int,
            help="batch requests that may wait for a slot; more are shed at once (default: %(default)s)")
    _option(p, "--batch-wait-s", "5", type=float,
            help="seconds a batch request may wait for a slot before it is shed (default: %(default)s)")
    _option(p, "--online-priority", "0", type=int,
            help="without --class-header, a request whose body's priority is above this is batch "
            "(default: %(default)s, vLLM's default)")
    _option(p, "--class-header",
            help="a header the deployment's gateway sets (and overwrites) to 'batch' or 'online'; when "
            "given, it alone decides the class")
    _option(p, "--preempt-batch", "on", choices=("on", "off"),
            help="with --online-first: an online request that finds the router full takes the newest "
            "forwarded batch request's slot (its upstream call is cancelled, so vLLM aborts it; the client "
            "gets 429 batch_shed and sends it again). Streamed answers are never taken back (default: on)")
    _option(p, "--online-reserve", "0", type=int, metavar="R",
            help="with --online-first: slots batch requests may not hold while online traffic is recent; an "
            "arriving online request withdraws the newest batch ones over that at once. N: online steps to "
            "themselves (a compute-bound engine). 0: off (default: %(default)s, docs/shared-capacity.md)")
    _option(p, "--online-quiet-s", "1.0", type=float,
            help="with --online-reserve: seconds after the last online request before batch requests may "
            "take the reserve again (default: %(default)s)")
    _option(p, "--admin-token-file",
            help="a file (a mounted Secret) with the token POST /v1/load_lora_adapter must carry in the "
            "X-AIBrix-Admin-Token header; without it that route is off (docs/trust.md)")
    _option(p, "--lora-registry",
            help="the deployment's adapter registry ([aibrix_batch] lora_adapters): only its adapters load")
    _option(p, "--lora-cache-dir",
            help="the adapters' verified cache as the instances see it ([aibrix_batch] lora_cache_dir): "
            "an adapter loads only from <dir>/<name>/<manifest digest>")
    p.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU (benchmarks)")
    args = p.parse_args(argv)
    if args.idle_timeout_s <= 0 or args.body_timeout_s <= 0:
        p.error("--idle-timeout-s and --body-timeout-s must be > 0")
    if args.max_connections < 1:
        p.error("--max-connections must be >= 1")
    if args.online_first < 0 or args.batch_queue < 0 or args.batch_wait_s <= 0:
        p.error("--online-first and --batch-queue must be >= 0 and --batch-wait-s > 0")
    if args.affinity_slack < 0 or args.affinity_entries < 1:
        p.error("--affinity-slack must be >= 0 and --affinity-entries >= 1")
    if not (args.decode or args.decode_dns):
        p.error("at least one decode instance (--decode or --decode-dns) is needed")
    if bool(args.lora_registry) != bool(args.lora_cache_dir):
        p.error("--lora-registry and --lora-cache-dir go together")
    try:
        args.admin = admin_from(args)
    except (AdminConfigError, AdapterRegistryError) as exc:
        p.error(str(exc))
    return args


def admin_from(args: argparse.Namespace) -> AdminPolicy:
    """The admin policy the flags describe; read once at startup, a bad file stops the router."""
    token = read_token(args.admin_token_file) if args.admin_token_file else None
    registry = Path(args.lora_registry) if args.lora_registry else None
    if registry is not None:
        load_registry(registry)  # a bad file stops the router now, not at the first load
    cache_dir = Path(args.lora_cache_dir) if args.lora_cache_dir else None
    return AdminPolicy(token=token, registry=registry, cache_dir=cache_dir)


def admission_from(args: argparse.Namespace) -> Admission | None:
    if not args.online_first:
        return None
    try:
        return Admission(args.online_first, batch_queue=args.batch_queue, batch_wait_s=args.batch_wait_s,
                         online_priority=args.online_priority, class_header=args.class_header,
                         preempt_batch=args.preempt_batch == "on", online_reserve=args.online_reserve,
                         online_quiet_s=args.online_quiet_s)
    except ValueError as exc:  # the reserve against --online-first's slots: said before serving
        raise SystemExit(f"router: {exc} (--online-reserve, --online-quiet-s)") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    backends = [parse_backend(u, PREFILL) for u in args.prefill] + [
        parse_backend(u, DECODE) for u in args.decode
    ]
    dns = {role: t for role, t in ((PREFILL, args.prefill_dns), (DECODE, args.decode_dns)) if t}
    app = build_app(backends, health_interval_s=args.health_interval_s,
                    request_timeout_s=args.request_timeout_s, body_timeout_s=args.body_timeout_s, dns=dns,
                    prefix_affinity=args.prefix_affinity == "on", affinity_entries=args.affinity_entries,
                    affinity_slack=args.affinity_slack, admission=admission_from(args),
                    admin=args.admin)  # fmt: skip
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # the image installs uvloop; a bare checkout may lack it
        loop_factory = None
    # aiohttp's keep-alive timer runs from the moment a connection opens and after every
    # answer, and closes the connection if no whole request has arrived by then: one bound for
    # idle connections and for headers sent a byte at a time (slowloris). --max-connections
    # bounds how many there are (serve.py).
    serve.run(
        app, host=args.host, port=args.port, max_connections=args.max_connections,
        announce=lambda s: print(s, flush=True), loop=loop_factory() if loop_factory else None,
        access_log=None, keepalive_timeout=args.idle_timeout_s,
        # After an answer to a request whose body is unread (the 408 of a slow body), aiohttp
        # reads and drops the rest for this long before closing, so the client gets the answer
        # rather than a reset; 2 s, not aiohttp's 10, keeps the slow client's hold short.
        lingering_time=2.0,
        handle_signals=True, shutdown_timeout=args.shutdown_timeout_s,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
