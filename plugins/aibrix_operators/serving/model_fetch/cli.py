"""``python -m aibrix_operators.serving.model_fetch``'s command line: arguments (flags or the
pod's environment), the one-line failure on stderr and in the termination message, and the exit
status of its kind (``dest.EXIT_*``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from aibrix_operators.serving.model_fetch import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_WORKERS,
    EXIT_USAGE,
    FetchError,
    FetchOptions,
    fetch_model,
)
from aibrix_operators.serving.model_manifest import MANIFEST_NAME

# Kubernetes keeps at most 4096 bytes of a termination message.
TERMINATION_MESSAGE_BYTES = 4096


def write_termination_message(path: str | None, message: str) -> None:
    if not path:
        return
    try:
        with open(path, "wb") as fh:
            fh.write(message.encode("utf-8", "backslashreplace")[:TERMINATION_MESSAGE_BYTES])
    except OSError as exc:
        print(f"model_fetch: cannot write the termination message to {path}: {exc}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aibrix_operators.serving.model_fetch",
        description="Download a model from s3:// to a local directory, each file checked by its manifest.",
    )
    p.add_argument(
        "--source",
        default=os.environ.get("MODEL_SOURCE"),
        help="s3://bucket/prefix of the model (env MODEL_SOURCE)",
    )
    p.add_argument("--dest", required=True, type=Path, help="local directory, e.g. /models/model")
    p.add_argument(
        "--manifest",
        default=os.environ.get("MODEL_MANIFEST") or None,
        help=f"local path or s3:// URI (env MODEL_MANIFEST); default SOURCE/{MANIFEST_NAME}",
    )
    p.add_argument(
        "--manifest-sha256",
        default=os.environ.get("MODEL_MANIFEST_SHA256") or None,
        help="the manifest's own sha256, pinned by the deployment (env MODEL_MANIFEST_SHA256)",
    )
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--max-bytes-per-s", type=float, default=None)
    p.add_argument("--reverify", action="store_true", help="re-hash files already verified")
    p.add_argument(
        "--termination-log",
        default=None,
        help="where a failure's one-line reason goes too (a pod's terminationMessagePath)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not args.source:
            raise FetchError("no --source (or MODEL_SOURCE): give the model's s3://bucket/prefix", EXIT_USAGE)
        if args.workers < 1 or args.chunk_bytes < 1:
            raise FetchError("--workers and --chunk-bytes must be positive", EXIT_USAGE)
        options = FetchOptions(
            workers=args.workers,
            chunk_bytes=args.chunk_bytes,
            max_bytes_per_s=args.max_bytes_per_s,
            reverify=args.reverify,
        )
        report = fetch_model(
            args.source,
            args.dest,
            manifest=args.manifest,
            manifest_sha256=args.manifest_sha256,
            options=options,
        )
    except FetchError as exc:
        message = f"model fetch failed: {exc}"
        print(message, file=sys.stderr, flush=True)
        write_termination_message(args.termination_log, message)
        return exc.exit_code
    print(report.as_json(), flush=True)
    return 0
