"""``aibrix-batch``: submit and follow batches from a shell (verbs like ``gh`` / ``kubectl``).

Built on ``BatchClient``; output for people on stdout, progress on stderr (a bar only on a
TTY), ``--json`` for scripts, one-line errors with the exit codes of ``errors.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from aibrix_operators.batch.cost import describe as describe_cost
from aibrix_operators.batch.error_codes import RequestError
from aibrix_operators.batch.lifecycle import TERMINAL as ENDED
from aibrix_operators.batch.lifecycle import BatchStatus
from aibrix_operators.batch.records import DEFAULT_COMPLETION_WINDOW
from aibrix_operators.batch_api import extensions
from aibrix_operators.client.errors import ClientError, ExitCode, describe
from aibrix_operators.client.profile import API_KEY_ENV, BASE_URL_ENV, CONFIG_ENV, PROFILE_ENV, resolve
from aibrix_operators.client.progress import RateMeter, TransferBar, batch_progress, request_tally

PROG = "aibrix-batch"
LARGE_FILE = 8 << 20  # uploads and downloads over this size get a bar (on a TTY)

MAIN_HELP = f"""\
Submit OpenAI-format batch files to the Batch API of an Airflow deployment and follow them.

examples:
  {PROG} create --input examples/chat_batch.jsonl --wait
  {PROG} status batch_0a75… --watch
  {PROG} results batch_0a75… -o output.jsonl

connection (each value on its own: flag > environment > profile file):
  --base-url / {BASE_URL_ENV}    e.g. http://127.0.0.1:8080 (/openai/v1 is added)
  --api-key  / {API_KEY_ENV}
  profile file: ~/.config/aibrix-batch/config.yaml, or ${CONFIG_ENV};
                --profile / ${PROFILE_ENV} picks one of its profiles

exit codes:
  0  done (for create --wait / status: the batch completed)
  1  the batch failed, expired or was cancelled (or has no results yet)
  2  usage: bad flags, a bad input file (every line is checked before upload;
     nothing is sent), an id or request the API refused
  3  the Batch API is unreachable, failed, or refused the API key
  4  a bug in {PROG} (AIBRIX_BATCH_DEBUG=1 shows the traceback)

counts: a cancelled or expired batch's "failed" (the API's) also holds the
requests it left unanswered; shown apart once the batch is finalized ("N not
answered (cancelled), M failed"), as "N cancelled or failed" before, beside
"completed", never as failures of a 100% done batch.
"""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that names the help to read."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _common() -> argparse.ArgumentParser:
    # SUPPRESS: a flag given before the verb is not overwritten by the verb's default.
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--base-url", default=argparse.SUPPRESS, help=f"Batch API URL (env {BASE_URL_ENV})")
    g.add_argument("--api-key", default=argparse.SUPPRESS, help=f"API key (env {API_KEY_ENV})")
    g.add_argument("--profile", default=argparse.SUPPRESS, help="profile of the profile file")
    g.add_argument("--timeout", dest="http_timeout_s", type=float, default=argparse.SUPPRESS, metavar="S",
                   help="seconds to wait for each API answer (default 60)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="machine-readable output on stdout")
    return p


def build_parser() -> Parser:
    common = _common()
    parser = Parser(prog=PROG, description=MAIN_HELP, parents=[common],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    verbs.required = True

    def verb(name: str, summary: str, example: str) -> argparse.ArgumentParser:
        return verbs.add_parser(name, help=summary, description=summary, parents=[common],
                                epilog=f"example:\n  {example}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)

    create = verb("create", "check every line of a batch file, upload it and create its batch; prints the "
                  "id and monitor URL (a bad line: exit 2, nothing uploaded)",
                  f"{PROG} create --input eval.jsonl --window 8h --metadata project=llama3-eval "
                  "--config pool.yaml --wait")
    create.add_argument("--input", "-i", required=True, metavar="FILE", help="OpenAI batch JSONL file")
    create.add_argument("--endpoint", help="default: the url of the file's first line")
    create.add_argument("--window", default=DEFAULT_COMPLETION_WINDOW,
                        help=f"completion window: 24h, 90m, 3600s (default {DEFAULT_COMPLETION_WINDOW})")
    create.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="batch metadata; repeat for more")
    create.add_argument("--idempotency-key", help="a retry with the same key returns the same batch")
    create.add_argument("--config", "-c", metavar="POOL.yaml",
                        help="job-pool file: pool: {max_workers, memory_per_job, gpu_policy, "
                        "requests_per_shard, concurrency} (docs/job-pool.md) and stop_rules: "
                        "{max_error_rate, error_rate_min_sample, max_total_tokens} (docs/stop-rules.md; "
                        "the flags below win)")
    create.add_argument("--max-error-rate", type=float, metavar="RATE",
                        help="stop the batch once more than this share (0-1) of its answers are the "
                             "requests' own errors (docs/stop-rules.md)")
    create.add_argument("--error-rate-min-sample", type=int, metavar="N",
                        help="answers before --max-error-rate is judged (default 100)")
    create.add_argument("--max-total-tokens", type=int, metavar="N",
                        help="stop the batch once it used N tokens (input + output)")
    create.add_argument("--dry-run", action="store_true",
                        help="check the file and print when the batch would be done and what it would cost "
                             "at the deployment's measured rate; nothing is uploaded or sent")
    create.add_argument("--wait", action="store_true", help="follow the batch until it ends")
    status = verb("status", "show a batch's status and progress",
                  f"{PROG} status batch_0a750e3a913c42cf9aa498ddbbbcaf08 --watch")
    status.add_argument("batch_id", metavar="ID")
    status.add_argument("--watch", "-w", action="store_true",
                        help="follow until it ends (polls once a second)")
    listing = verb("list", "list batches, newest first", f"{PROG} list --limit 5")
    listing.add_argument("--limit", type=int, default=20, metavar="N", help="how many (default 20)")
    listing.add_argument("--all", action="store_true", help="every batch, page after page")
    results = verb("results", "download a finished batch's output (or errors)",
                   f"{PROG} results batch_0a750e3a913c42cf9aa498ddbbbcaf08 -o output.jsonl")
    results.add_argument("batch_id", metavar="ID")
    results.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    results.add_argument("--errors", action="store_true", help="the error lines instead of the output")
    results.add_argument("--partial", action="store_true",
                         help="while the batch runs: the answers of the shards finished so far "
                              "(shard by shard; the final output is in input order)")
    cancel = verb("cancel", "cancel a batch (answers so far are kept)",
                  f"{PROG} cancel batch_0a750e3a913c42cf9aa498ddbbbcaf08")
    cancel.add_argument("batch_id", metavar="ID")
    return parser


def parse_metadata(items: Sequence[str]) -> dict[str, str] | None:
    metadata: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ClientError(f"--metadata {item!r} must be KEY=VALUE")
        metadata[key] = value
    return metadata or None


# ---------------------------------------------------------------------- output
class Out:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def batch(self, batch: Any) -> None:
        if self.as_json:
            print(json.dumps(batch.model_dump(mode="json")), flush=True)
        else:
            print(describe_batch(batch), flush=True)


def describe_batch(batch: Any) -> str:
    lines = [f"{batch.id}  {batch.status}"]
    if batch.request_counts is not None:
        tally = request_tally(batch)
        lines.append(f"  requests   {tally.total} total, {tally.completed} completed, {tally.failed_words()}")
        if tally.cut_off_by and tally.failed and tally.unanswered is None:
            code = (RequestError.BATCH_CANCELLED if tally.cut_off_by == "cancelled"
                    else RequestError.BATCH_EXPIRED)
            lines.append(f"             (the API counts the requests left unanswered as failed; their "
                         f"error lines have code {code})")
    lines.append(f"  endpoint   {batch.endpoint}  window {batch.completion_window}  "
                 f"input {batch.input_file_id}")
    if batch.metadata:
        lines.append("  metadata   " + ", ".join(f"{k}={v}" for k, v in batch.metadata.items()))
    usage = getattr(batch, "usage", None)
    if usage is not None:
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        lines.append(f"  usage      {usage.input_tokens} input ({cached} cached) + {usage.output_tokens} "
                     f"output tokens{'' if batch.status in ENDED else ' so far'}")
    if estimate := (batch.model_extra or {}).get(extensions.ESTIMATE):
        lines.append("  estimate   " + describe_estimate(estimate))
    if cost := describe_cost((batch.model_extra or {}).get(extensions.COST)):
        lines.append(f"  cost       {cost}{'' if batch.status in ENDED else ' so far'}")
    for error in (batch.errors.data if batch.errors and batch.errors.data else [])[:5]:
        where = f" line {error.line}" if error.line else ""
        lines.append(f"  error      {error.code}{where}: {' '.join(str(error.message or '').split())[:200]}")
    if batch.output_file_id:
        lines.append(f"  output     {batch.output_file_id}  ({PROG} results {batch.id} -o output.jsonl)")
    if batch.error_file_id:
        lines.append(f"  errors     {batch.error_file_id}  "
                     f"({PROG} results {batch.id} --errors -o errors.jsonl)")
    monitor = getattr(batch, "monitor_url", None)
    if monitor:
        lines.append(f"  monitor    {monitor}")
    return "\n".join(lines)


def describe_dry_run(answer: dict[str, Any]) -> str:
    """A dry run's answer for people: the work, the estimate, the cost; nothing was sent."""
    work, estimate = answer["work"], answer["estimate"]
    lines = [f"dry run: nothing uploaded or sent ({answer['model']}, {answer['endpoint']}, "
             f"window {answer['completion_window']})",
             f"  requests   {work['requests']}, {work['input_bytes']} bytes",
             f"  output     at most {work['max_output_tokens']} tokens by max_tokens"
             + (f", {n} line(s) without max_tokens" if (n := work["unbounded_requests"]) else "")]
    if estimate.get("tokens") is not None:
        lines.append(f"  tokens     {estimate['input_tokens']} input (from bytes) + "
                     f"{estimate['output_tokens']} output at most, behind {estimate['ahead_tokens']} queued")
    lines.append("  estimate   " + describe_estimate(estimate))
    if cost := describe_cost(answer.get("cost")):
        lines.append(f"  cost       at most {cost}")
    return "\n".join(lines)


def describe_estimate(estimate: dict[str, Any]) -> str:
    """When the batch will be done and on what basis; a window it will not meet says so."""
    when = estimate.get("completion_at")
    text = (f"done by {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(when))} UTC" if isinstance(when, int)
            else "no estimate")
    text += f" ({estimate.get('basis')})"
    if estimate.get("feasible") is False:
        text += (f"; AT RISK: after its window ends; the shortest window that would be met is "
                 f"{estimate.get('earliest_window')}")
    return text


def batch_exit(batch: Any) -> ExitCode:
    return ExitCode.BATCH_NOT_DONE if batch.status in ("failed", "expired", "cancelled") else ExitCode.OK


# ---------------------------------------------------------------------- verbs
def follow(client: Any, batch_id: str, out: Out, sleep: Callable[[float], None] = time.sleep) -> Any:
    """Poll once a second: a redrawn line on a TTY, a line per change elsewhere."""
    meter = RateMeter()
    tty = sys.stderr.isatty()
    last = [""]

    def show(batch: Any) -> None:
        counts = batch.request_counts
        meter.observe(counts.completed + counts.failed if counts else 0)
        line = batch_progress(batch, meter)
        if out.as_json:
            if _state(batch) != last[0]:
                print(json.dumps(batch.model_dump(mode="json")), flush=True)
        elif tty:
            sys.stderr.write("\r" + line + "\x1b[K")
            sys.stderr.flush()
        elif _state(batch) != last[0]:
            print(line, file=sys.stderr, flush=True)
        last[0] = _state(batch)

    batch = client.wait(batch_id, on_progress=show, poll_s=1.0, sleep=sleep)
    if tty and not out.as_json:
        sys.stderr.write("\n")
    return batch


def _state(batch: Any) -> str:
    c = batch.request_counts
    return f"{batch.status} {c.completed if c else 0} {c.failed if c else 0}"


def _stop_rules(args: argparse.Namespace) -> dict[str, Any] | None:
    rules = {"max_error_rate": args.max_error_rate, "error_rate_min_sample": args.error_rate_min_sample,
             "max_total_tokens": args.max_total_tokens}
    return {k: v for k, v in rules.items() if v is not None} or None


def cmd_create(client: Any, args: argparse.Namespace, out: Out) -> ExitCode:
    if args.dry_run:
        answer = client.dry_run(args.input, completion_window=args.window, endpoint=args.endpoint)
        print(json.dumps(answer) if out.as_json else describe_dry_run(answer), flush=True)
        return ExitCode.OK
    metadata = parse_metadata(args.metadata)
    size = os.path.getsize(args.input) if os.path.isfile(args.input) else 0
    upload_bar = TransferBar(f"uploading {os.path.basename(args.input)}", size,
                             enabled=None if size >= LARGE_FILE and not out.as_json else False)
    batch = client.create_batch(input_file=args.input, completion_window=args.window, metadata=metadata,
                                endpoint=args.endpoint, idempotency_key=args.idempotency_key,
                                pool=args.config, stop_rules=_stop_rules(args),
                                on_upload=lambda done, _total: upload_bar.update(done))
    upload_bar.close()
    if out.as_json:
        out.batch(batch)
    else:
        print(f"created {batch.id}  {batch.status}", flush=True)
        if getattr(batch, "monitor_url", None):
            print(f"  monitor    {batch.monitor_url}", flush=True)
    if not args.wait:
        return ExitCode.OK
    done = follow(client, batch.id, Out(False) if not out.as_json else out)
    if not out.as_json:
        print(describe_batch(done), flush=True)
    return batch_exit(done)


def cmd_status(client: Any, args: argparse.Namespace, out: Out) -> ExitCode:
    if args.watch:
        batch = follow(client, args.batch_id, out)
        if not out.as_json:
            print(describe_batch(batch), flush=True)
        return batch_exit(batch)
    batch = client.retrieve(args.batch_id)
    out.batch(batch)
    return batch_exit(batch)


def cmd_list(client: Any, args: argparse.Namespace, out: Out) -> ExitCode:
    if not 1 <= args.limit <= 100:
        raise ClientError("--limit must be between 1 and 100 (use --all for every batch)")
    pages = iter(client.list(limit=args.limit, all=args.all))
    # Nothing on stdout before the first page arrived: a refused key or a stopped server is an
    # error on stderr and an exit code, not a lone "[" or a table header.
    first = next(pages, None)
    batches = itertools.chain([first], pages) if first is not None else iter(())
    if out.as_json:
        # A JSON array, written as the pages arrive (--all may be long). A later page that fails
        # leaves it unclosed: never a complete-looking array, and the exit code says so.
        sys.stdout.write("[")
        for i, batch in enumerate(batches):
            sys.stdout.write(("," if i else "") + "\n" + json.dumps(batch.model_dump(mode="json")))
        sys.stdout.write("\n]\n")
        return ExitCode.OK
    print(f"{'ID':<40} {'STATUS':<11} {'DONE/TOTAL':>12} {'CREATED':<16} ENDPOINT")
    for batch in batches:
        c = batch.request_counts
        progress = f"{request_tally(batch).done}/{c.total}" if c else "-"
        created = (time.strftime("%Y-%m-%d %H:%M", time.localtime(batch.created_at))
                   if batch.created_at else "-")
        print(f"{batch.id:<40} {batch.status:<11} {progress:>12} {created:<16} {batch.endpoint}", flush=True)
    return ExitCode.OK


def cmd_results(client: Any, args: argparse.Namespace, out: Out) -> ExitCode:
    batch = client.retrieve(args.batch_id)
    kind = "errors" if args.errors else "output"
    from aibrix_operators.client.batch_client import TERMINAL

    if args.partial and args.errors:
        raise ClientError("--partial reads answers only; the error lines come with the batch's end")
    partial = args.partial and batch.status not in TERMINAL
    if args.output is None:
        written = 0
        for chunk in client.result_chunks(batch, errors=args.errors, partial=partial):
            sys.stdout.buffer.write(chunk)
            written += len(chunk)
        sys.stdout.buffer.flush()
        return ExitCode.OK
    counts = batch.request_counts
    expected = (counts.failed if args.errors else counts.completed) if counts else 0
    bar = TransferBar(f"downloading {kind}", None, enabled=None if expected > 10_000 else False)
    written = client.download(batch, args.output, errors=args.errors, on_progress=bar.update, partial=partial)
    bar.close()
    if partial:
        shards = (batch.model_extra or {}).get(extensions.SHARDS) or {}
        done, total = shards.get("done", 0), shards.get("total", "?")
        print(f"wrote the answers of the {done} finished shards (of {total}; {written} bytes) of "
              f"{batch.id} to {args.output}; the batch is still {batch.status}")
        return ExitCode.OK
    if out.as_json:
        print(json.dumps({"batch_id": batch.id, "status": batch.status, "kind": kind,
                          "file": args.output, "bytes": written, "lines": expected}))
    else:
        print(f"wrote {expected} {kind} lines ({written} bytes) of {batch.id} to {args.output}")
    return ExitCode.OK


def cmd_cancel(client: Any, args: argparse.Namespace, out: Out) -> ExitCode:
    from aibrix_operators.client.batch_client import TERMINAL

    # Looked at first: the API answers a cancel of an ended batch with the batch unchanged, so
    # only the status before says whether this call cancelled anything.
    before = client.retrieve(args.batch_id)
    ended = before.status in TERMINAL or before.status == BatchStatus.CANCELLING
    batch = before if ended else client.cancel(args.batch_id)
    if out.as_json:
        out.batch(batch)
    elif ended:
        print(f"{batch.id} already {batch.status}; nothing to cancel")
    else:
        print(f"{batch.id}  {batch.status}  (answers so far are kept: {PROG} status {batch.id} --watch)")
    return ExitCode.OK


VERBS = {"create": cmd_create, "status": cmd_status, "list": cmd_list, "results": cmd_results,
         "cancel": cmd_cancel}


def main(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    base_url = key_source = ""
    try:
        from aibrix_operators.client.batch_client import BatchClient  # the slow import: not for --help

        conn = resolve(getattr(args, "base_url", None), getattr(args, "api_key", None),
                       getattr(args, "profile", None), env)
        base_url, key_source = conn.base_url, conn.api_key_source
        client = BatchClient(conn.base_url, conn.api_key, timeout=getattr(args, "http_timeout_s", 60.0))
        return int(VERBS[args.verb](client, args, Out(getattr(args, "json", False))))
    except KeyboardInterrupt:
        batch_id = getattr(args, "batch_id", None)
        hint = f"; the batch goes on: {PROG} status {batch_id}" if batch_id else ""
        print(f"\n{PROG}: interrupted{hint}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `aibrix-batch list | head`: the reader left; not an error worth a message.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        if env.get("AIBRIX_BATCH_DEBUG"):
            raise
        code, message = describe(exc, base_url, key_source)
        print(f"{PROG} {args.verb}: error: {message}", file=sys.stderr)
        return int(code)


if __name__ == "__main__":
    sys.exit(main())
