"""Fetch a model from an ``s3://`` prefix into a node-local directory, every byte verified.

What a vLLM pod's init container runs (k8s overlays, docs/model-delivery.md)::

    python -m aibrix_operators.serving.model_fetch --source s3://bucket/prefix --dest /models/model

* **Exactly the manifest** (``model_manifest.py``): the files it lists, at its checked paths,
  each accepted only if its size and sha256 match. The manifest defaults to
  ``SOURCE/model-manifest.json``; ``--manifest-sha256`` pins it, so a bucket writer cannot swap
  weights and manifest together.
* **Hashed while streaming**: large files come as parallel ranged GETs written in place
  (``pwrite``) and hashed in order from memory as they arrive, never read back. A window of
  chunks bounds the memory that out-of-order arrivals hold.
* **Resumable**: a file is written to ``.model-fetch/parts/``, fsynced, verified, renamed into
  place and recorded in ``.model-fetch/verified.jsonl`` (size, sha256, mtime). A restarted fetch
  skips a recorded file whose size and mtime still match, re-hashes an unrecorded one already
  in place (a crash between rename and record), and downloads the rest; an interrupted partial
  file starts over (its hash state died with the process).
* **One-line failures**: the reason (which file, what is wrong, what to do) goes to stderr and,
  with ``--termination-log``, to the file Kubernetes shows as the container's termination
  message; the exit status says the kind (see ``EXIT_*``).

S3 access is boto3's usual chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as
``storage.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aibrix_operators.serving.model_manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    STATE_DIR,
    ManifestError,
    ManifestFile,
    parse_manifest,
    sha256_file,
)
from aibrix_operators.storage import StorageError, default_s3_client, split_s3_uri

EXIT_FAILED = 1  # anything else (a local disk error, ...)
EXIT_USAGE = 2  # bad arguments, or a manifest that is unusable or does not match its pin
EXIT_MISSING = 3  # an object the manifest lists is not in the store
EXIT_MISMATCH = 4  # an object's size or sha256 is not the manifest's
EXIT_STORE = 5  # the store refused or could not be reached (after boto3's retries)

DEFAULT_WORKERS = 16
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
JOURNAL = "verified.jsonl"
# Kubernetes keeps at most 4096 bytes of a termination message.
TERMINATION_MESSAGE_BYTES = 4096


class FetchError(Exception):
    """A fetch that cannot complete; ``str()`` is the one-line reason, ``exit_code`` its kind."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class FetchOptions:
    workers: int = DEFAULT_WORKERS  # parallel GETs (ranges of one file or of several)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # one ranged GET
    window_chunks: int = 0  # chunks fetched but not yet hashed; 0: 2 x workers
    max_bytes_per_s: float | None = None  # a cap, to leave the node's network to others
    reverify: bool = False  # re-hash files the journal says are verified


@dataclass
class FetchReport:
    files: int = 0
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already verified: not downloaded
    bytes_downloaded: int = 0  # bytes received from the store in this run
    bytes_total: int = 0  # the model's size
    seconds: float = 0.0

    def as_json(self) -> str:
        mb_s = self.bytes_downloaded / 1e6 / self.seconds if self.seconds > 0 else 0.0
        return json.dumps(
            {
                "event": "model_fetched",
                "files": self.files,
                "fetched_files": len(self.fetched),
                "skipped_files": len(self.skipped),
                "bytes_downloaded": self.bytes_downloaded,
                "bytes_total": self.bytes_total,
                "seconds": round(self.seconds, 3),
                "mb_per_s": round(mb_s, 1),
            }
        )


# ---------------------------------------------------------------------------- the store


def s3_client(workers: int) -> Any:
    from botocore.config import Config

    # One pooled connection per worker, or the workers queue for connections.
    return default_s3_client(
        Config(max_pool_connections=workers + 2, retries={"mode": "standard", "max_attempts": 5})
    )


def _store_error(exc: Exception, uri: str, path: str) -> FetchError:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        if code in ("NoSuchKey", "404", "NotFound"):
            return FetchError(
                f"{path}: {uri} is missing from the store ({code}); upload it or fix the manifest",
                EXIT_MISSING,
            )
        if code == "InvalidRange":
            return FetchError(
                f"{path}: {uri} is smaller than the manifest says; re-upload it or fix the manifest",
                EXIT_MISMATCH,
            )
        return FetchError(f"{path}: cannot read {uri}: {code} {err.get('Message', '')}".rstrip(), EXIT_STORE)
    return FetchError(f"{path}: cannot read {uri}: {type(exc).__name__}: {exc}", EXIT_STORE)


def read_manifest(location: str, client: Any, pin: str | None) -> list[ManifestFile]:
    """The manifest at a local path or ``s3://`` URI, checked against its pinned sha256."""
    try:
        if location.startswith("s3://"):
            bucket, key = split_s3_uri(location)
            try:
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
                data = body.read(MAX_MANIFEST_BYTES + 1)
            except Exception as exc:  # noqa: BLE001 - botocore's errors, named in one line
                raise _store_error(exc, location, "manifest") from exc
        else:
            with open(location, "rb") as fh:
                data = fh.read(MAX_MANIFEST_BYTES + 1)
    except (StorageError, OSError) as exc:
        raise FetchError(f"manifest {location}: {exc}", EXIT_USAGE) from exc
    if pin is not None and hashlib.sha256(data).hexdigest() != pin.lower():
        raise FetchError(
            f"manifest {location}: sha256 {hashlib.sha256(data).hexdigest()} is not the pinned "
            f"{pin}; publish the manifest the deployment pins, or update the pin",
            EXIT_USAGE,
        )
    try:
        return parse_manifest(data, f"manifest {location}")
    except ManifestError as exc:
        raise FetchError(str(exc), EXIT_USAGE) from exc


# ---------------------------------------------------------------------------- the journal


class Journal:
    """``verified.jsonl``: one line per file accepted, appended and fsynced after its rename."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def load(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                entry = json.loads(line)
                out[entry["path"]] = entry
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash mid-append: that file is re-hashed
        return out

    def record(self, f: ManifestFile, mtime_ns: int) -> None:
        line = json.dumps({"path": f.path, "size": f.size, "sha256": f.sha256, "mtime_ns": mtime_ns}) + "\n"
        with self._lock, open(self.path, "ab") as fh:
            fh.write(line.encode())
            fh.flush()
            os.fsync(fh.fileno())


# ---------------------------------------------------------------------------- fetching


class _Throttle:
    def __init__(self, max_bytes_per_s: float | None) -> None:
        self.rate, self.start, self.sent = max_bytes_per_s, time.monotonic(), 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            self.sent += n
            wait = self.sent / self.rate - (time.monotonic() - self.start)
        if wait > 0:
            time.sleep(wait)


@dataclass
class _FileJob:
    """One file in flight: chunks land in the part file by offset and are hashed in order."""

    index: int
    entry: ManifestFile
    target: Path
    part: Path
    fd: int
    chunks: int
    hasher: Any = field(default_factory=hashlib.sha256)
    next_chunk: int = 0  # the next chunk to hash
    pending: dict[int, bytes] = field(default_factory=dict)  # arrived, waiting for earlier ones
    draining: bool = False  # a thread is hashing this file's chunks
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class ModelFetcher:
    def __init__(
        self,
        source: str,
        dest: Path,
        files: list[ManifestFile],
        client: Any,
        options: FetchOptions = FetchOptions(),
    ) -> None:
        if not source.startswith("s3://"):
            raise FetchError(f"--source {source!r}: not an s3://bucket/prefix URI", EXIT_USAGE)
        try:
            self.bucket, prefix = split_s3_uri(source)
        except StorageError as exc:
            raise FetchError(str(exc), EXIT_USAGE) from exc
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self.dest, self.files, self.client, self.opts = Path(dest), files, client, options
        self.state = self.dest / STATE_DIR
        self.journal = Journal(self.state / JOURNAL)
        self.report = FetchReport(files=len(files), bytes_total=sum(f.size for f in files))
        self._window = threading.Semaphore(options.window_chunks or 2 * options.workers)
        self._throttle = _Throttle(options.max_bytes_per_s)
        self._count_lock = threading.Lock()
        self._failed: FetchError | None = None
        self._remaining = 0
        self._all_done = threading.Event()

    def uri(self, f: ManifestFile) -> str:
        return f"s3://{self.bucket}/{self.prefix}{f.path}"

    # -- the plan
    def _target(self, f: ManifestFile) -> Path:
        target = self.dest / f.path
        # The manifest's paths are checked as text; this catches a symlink already in dest.
        root = os.path.realpath(self.dest)
        if os.path.commonpath([root, os.path.realpath(target)]) != root:
            raise FetchError(f"{f.path}: resolves outside {self.dest}; refusing to write there", EXIT_USAGE)
        return target

    def _check_no_strangers(self) -> None:
        listed = {f.path for f in self.files}
        for path in sorted(self.dest.rglob("*")):
            rel = path.relative_to(self.dest).as_posix()
            if rel.split("/")[0] == STATE_DIR or path.is_dir() and not path.is_symlink():
                continue
            if rel not in listed:
                # vLLM would load a stray shard beside the model's own; never delete on a guess.
                raise FetchError(
                    f"{self.dest}: holds {rel}, which the manifest does not list; "
                    "fetch into an empty directory",
                    EXIT_USAGE,
                )

    def _already_verified(self, f: ManifestFile, target: Path, journal: dict[str, dict[str, Any]]) -> bool:
        try:
            st = target.lstat()
        except FileNotFoundError:
            return False
        if not target.is_file() or target.is_symlink() or st.st_size != f.size:
            target.unlink()
            return False
        seen = journal.get(f.path)
        if not self.opts.reverify and seen == {
            "path": f.path,
            "size": f.size,
            "sha256": f.sha256,
            "mtime_ns": st.st_mtime_ns,
        }:
            return True
        if sha256_file(target) == f.sha256:  # in place but unrecorded (or --reverify)
            self.journal.record(f, st.st_mtime_ns)
            return True
        target.unlink()
        return False

    # -- the run
    def run(self) -> FetchReport:
        start = time.monotonic()
        try:
            self.dest.mkdir(parents=True, exist_ok=True)
            (self.state / "parts").mkdir(parents=True, exist_ok=True)
            for stale in (self.state / "parts").iterdir():
                stale.unlink()  # an interrupted file starts over: its hash state is gone
            self._check_no_strangers()
            journal = self.journal.load()
            todo = []
            for i, f in enumerate(self.files):
                target = self._target(f)
                if self._already_verified(f, target, journal):
                    self.report.skipped.append(f.path)
                else:
                    todo.append((i, f, target))
            self._download(todo)
        except OSError as exc:
            raise FetchError(f"{self.dest}: {exc.strerror or exc} ({exc.filename or 'local disk'})") from exc
        finally:
            self.report.seconds = time.monotonic() - start
        return self.report

    def _download(self, todo: list[tuple[int, ManifestFile, Path]]) -> None:
        if not todo:
            return
        self._remaining = len(todo)
        jobs: list[_FileJob] = []
        try:
            self._schedule(todo, jobs)
        finally:  # the pool has finished: no thread writes any more
            for job in jobs:
                job.close()
                if self._failed:
                    job.part.unlink(missing_ok=True)  # a failed fetch leaves only verified files
        if self._failed:
            raise self._failed

    def _schedule(self, todo: list[tuple[int, ManifestFile, Path]], jobs: list[_FileJob]) -> None:
        with ThreadPoolExecutor(self.opts.workers, thread_name_prefix="model-fetch") as pool:
            for i, f, target in todo:
                part = self.state / "parts" / f"{i}.part"
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                chunks = max(1, -(-f.size // self.opts.chunk_bytes))
                job = _FileJob(i, f, target, part, fd, chunks)
                jobs.append(job)
                for c in range(chunks):
                    # Acquired in submission order, released once hashed: the oldest chunks
                    # always hold the permits, so every file's next chunk is on its way.
                    while not self._window.acquire(timeout=0.2):
                        if self._failed:
                            break
                    if self._failed:
                        break
                    pool.submit(self._fetch_chunk, job, c)
                if self._failed:
                    break
            while not self._all_done.wait(0.2) and not self._failed:
                pass
            if self._failed:
                pool.shutdown(wait=True, cancel_futures=True)

    def _fail(self, exc: FetchError) -> None:
        with self._count_lock:
            if self._failed is None:
                self._failed = exc
        self._window.release()  # a waiting scheduler notices the failure

    def _fetch_chunk(self, job: _FileJob, c: int) -> None:
        if self._failed:
            return
        try:
            data = self._get(job, c)
            view, offset = memoryview(data), c * self.opts.chunk_bytes
            while view:
                written = os.pwrite(job.fd, view, offset)
                view, offset = view[written:], offset + written
            self._deposit(job, c, data)
        except FetchError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(FetchError(f"{job.entry.path}: cannot write {job.part}: {exc.strerror or exc}"))
        except Exception as exc:  # noqa: BLE001 - one line naming the file, whatever boto3 raised
            self._fail(_store_error(exc, self.uri(job.entry), job.entry.path))

    def _get(self, job: _FileJob, c: int) -> bytes:
        f, uri = job.entry, self.uri(job.entry)
        key = self.prefix + f.path
        if f.size == 0:
            resp = self.client.get_object(Bucket=self.bucket, Key=key)
            total = int(resp["ContentLength"])
            data = resp["Body"].read(1)
        else:
            start = c * self.opts.chunk_bytes
            end = min(f.size, start + self.opts.chunk_bytes) - 1
            resp = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
            # "bytes a-b/TOTAL": the object's real size; without it a longer object whose first
            # SIZE bytes match would pass.
            content_range = str(resp.get("ContentRange") or "")
            total = int(content_range.rpartition("/")[2]) if content_range else int(resp["ContentLength"])
            data = resp["Body"].read()
            if total == f.size and len(data) != end - start + 1:
                raise FetchError(
                    f"{f.path}: {uri} sent {len(data)} bytes for range {start}-{end}; "
                    "the store cut the answer short or ignored the range, fetch again",
                    EXIT_STORE,
                )
        if total != f.size:
            raise FetchError(
                f"{f.path}: {uri} is {total} bytes, the manifest says {f.size}; "
                "re-upload the model with its manifest",
                EXIT_MISMATCH,
            )
        with self._count_lock:
            self.report.bytes_downloaded += len(data)
        self._throttle.take(len(data))
        return data

    def _deposit(self, job: _FileJob, c: int, data: bytes) -> None:
        with job.lock:
            job.pending[c] = data
            if job.draining:
                return  # the draining thread hashes it when its turn comes
            job.draining = True
        while True:
            with job.lock:
                chunk = job.pending.pop(job.next_chunk, None)
                if chunk is None:
                    job.draining = False
                    return
                job.next_chunk += 1
            job.hasher.update(chunk)  # releases the GIL: other files' chunks keep arriving
            self._window.release()
            if job.next_chunk == job.chunks:
                self._finish(job)
                return

    def _finish(self, job: _FileJob) -> None:
        f = job.entry
        os.fsync(job.fd)
        job.close()
        got = job.hasher.hexdigest()
        if got != f.sha256:
            job.part.unlink(missing_ok=True)
            raise FetchError(
                f"{f.path}: sha256 {got} of {self.uri(f)} is not the manifest's {f.sha256}; "
                "the object is corrupt or the manifest stale: re-upload both",
                EXIT_MISMATCH,
            )
        job.target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(job.part, job.target)
        _fsync_dir(job.target.parent)
        self.journal.record(f, job.target.stat().st_mtime_ns)
        with self._count_lock:
            self.report.fetched.append(f.path)
            self._remaining -= 1
            if self._remaining == 0:
                self._all_done.set()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fetch_model(
    source: str,
    dest: Path,
    *,
    manifest: str | None = None,
    manifest_sha256: str | None = None,
    client: Any = None,
    options: FetchOptions = FetchOptions(),
) -> FetchReport:
    """Fetch and verify every file the manifest lists; FetchError says why not."""
    client = client or s3_client(options.workers)
    files = read_manifest(manifest or source.rstrip("/") + "/" + MANIFEST_NAME, client, manifest_sha256)
    return ModelFetcher(source, dest, files, client, options).run()


# ---------------------------------------------------------------------------- the CLI


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


if __name__ == "__main__":
    sys.exit(main())
