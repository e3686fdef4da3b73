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
  file starts over (its hash state died with the process). ``--reverify`` (what the LoRA cache,
  a volume others can write, always uses) hashes every file in place and downloads again any
  whose digest is not the manifest's.
* **No links followed** under the destination: the destination, ``.model-fetch/``, its parts
  and every folder of a manifest path are opened with ``O_NOFOLLOW | O_DIRECTORY`` and used by
  descriptor, files created with ``O_EXCL | O_NOFOLLOW``, renamed and deleted by name in those
  folders. A symbolic link where a folder must be fails the fetch naming it; one where a file
  must be is replaced (deleting a link touches only the link).
* **One-line failures**: the reason (which file, what is wrong, what to do) goes to stderr and,
  with ``--termination-log``, to the file Kubernetes shows as the container's termination
  message; the exit status says the kind (see ``EXIT_*``).

S3 access is boto3's usual chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as
``storage.py``. The destination's link-safe folder and file handling and the journal are
``dest.py``; reading the manifest and the store's errors, ``store.py``; the command
line, ``cli.py``.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_MISMATCH", "EXIT_MISSING", "EXIT_STORE", "EXIT_USAGE", "JOURNAL",
           "FetchError", "FetchOptions", "FetchReport", "ModelFetcher", "fetch_model", "s3_client"]

import hashlib
import json
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aibrix_operators.serving.model_fetch.dest import (
    EXIT_FAILED,
    EXIT_MISMATCH,
    EXIT_MISSING,
    EXIT_STORE,
    EXIT_USAGE,
    JOURNAL,
    FetchError,
    Journal,
    not_real,
    open_dir,
    open_regular,
    sha256_fd,
)
from aibrix_operators.serving.model_fetch.store import _store_error, read_manifest, s3_client
from aibrix_operators.serving.model_manifest import (
    MANIFEST_NAME,
    STATE_DIR,
    ManifestFile,
)
from aibrix_operators.storage import StorageError, split_s3_uri

DEFAULT_WORKERS = 16
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class FetchOptions:
    workers: int = DEFAULT_WORKERS  # parallel GETs (ranges of one file or of several)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # one ranged GET
    window_chunks: int = 0  # chunks fetched but not yet hashed; 0: 2 x workers
    max_bytes_per_s: float | None = None  # a cap, to leave the node's network to others
    reverify: bool = False  # re-hash files the journal says are verified (the LoRA cache: always)


@dataclass
class FetchReport:
    files: int = 0
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already verified: not downloaded
    rejected: list[str] = field(default_factory=list)  # a local copy not the manifest's: fetched again
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
                "rejected_files": len(self.rejected),
                "bytes_downloaded": self.bytes_downloaded,
                "bytes_total": self.bytes_total,
                "seconds": round(self.seconds, 3),
                "mb_per_s": round(mb_s, 1),
            }
        )


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
    target: Path  # for messages; written as ``name`` in the folder ``dir_fd``
    dir_fd: int
    name: str
    part: Path  # for messages; ``part_name`` in the parts folder
    part_name: str
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
        self.report = FetchReport(files=len(files), bytes_total=sum(f.size for f in files))
        self._window = threading.Semaphore(options.window_chunks or 2 * options.workers)
        self._throttle = _Throttle(options.max_bytes_per_s)
        self._count_lock = threading.Lock()
        self._failed: FetchError | None = None
        self._remaining = 0
        self._all_done = threading.Event()
        # Folders under dest by relative path ("" is dest), opened without following links.
        self._dirs: dict[str, int] = {}
        self._parts_fd = -1
        self.journal: Journal | None = None

    def uri(self, f: ManifestFile) -> str:
        return f"s3://{self.bucket}/{self.prefix}{f.path}"

    # -- the folders, each a descriptor of a real directory
    def _dir(self, rel: str) -> int:
        """The folder ``rel`` under dest (created if missing), walked one name at a time with
        O_NOFOLLOW: a planted link anywhere below dest fails the fetch instead of leading out."""
        if rel not in self._dirs:
            parent, _, name = rel.rpartition("/")
            self._dirs[rel] = open_dir(name, self._dir(parent), str(self.dest / rel))
        return self._dirs[rel]

    def _open_state(self) -> None:
        self.dest.parent.mkdir(parents=True, exist_ok=True)  # dest's parents are the deployment's
        self._dirs[""] = open_dir(self.dest, None, str(self.dest))
        state_fd = self._dir(STATE_DIR)
        self._parts_fd = self._dir(f"{STATE_DIR}/parts")
        self.journal = Journal(state_fd, str(self.state / JOURNAL))

    def _close_state(self) -> None:
        if self.journal is not None:
            self.journal.close()
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def _clear_parts(self) -> None:
        parts = self._parts_fd
        for name in os.listdir(parts):
            if stat.S_ISDIR(os.stat(name, dir_fd=parts, follow_symlinks=False).st_mode):
                raise not_real(str(self.state / "parts" / name), "regular file", parts, name)
            os.unlink(name, dir_fd=parts)  # a file or a link: only the name goes

    # -- the plan
    def _place(self, f: ManifestFile) -> tuple[int, str]:
        """The folder (descriptor) and name ``f`` is written as; the manifest's paths are checked
        as text already, the folders here are real ones (``_dir``)."""
        parent, _, name = f.path.rpartition("/")
        return self._dir(parent), name

    def _check_no_strangers(self) -> None:
        listed = {f.path for f in self.files}
        for path in sorted(self.dest.rglob("*")):  # rglob does not descend into links
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

    def _already_verified(
        self, f: ManifestFile, dir_fd: int, name: str, journal: dict[str, dict[str, Any]]
    ) -> bool:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            raise not_real(str(self.dest / f.path), "regular file", dir_fd, name)
        opened = open_regular(name, dir_fd, os.O_RDONLY) if stat.S_ISREG(st.st_mode) else None
        if opened is None:  # a link, a FIFO, ...: deleting it deletes only the name
            os.unlink(name, dir_fd=dir_fd)
            self.report.rejected.append(f.path)
            return False
        fd, st = opened
        try:
            expected = {"path": f.path, "size": f.size, "sha256": f.sha256, "mtime_ns": st.st_mtime_ns}
            if st.st_size == f.size:
                if not self.opts.reverify and journal.get(f.path) == expected:
                    return True
                if sha256_fd(fd) == f.sha256:  # in place but unrecorded, or --reverify
                    if journal.get(f.path) != expected:
                        assert self.journal is not None
                        self.journal.record(f, st.st_mtime_ns)
                    return True
        finally:
            os.close(fd)
        os.unlink(name, dir_fd=dir_fd)  # not the manifest's bytes: fetched again, and verified
        self.report.rejected.append(f.path)
        return False

    # -- the run
    def run(self) -> FetchReport:
        start = time.monotonic()
        try:
            self._open_state()
            self._clear_parts()  # an interrupted file starts over: its hash state is gone
            self._check_no_strangers()
            assert self.journal is not None
            journal = self.journal.load()
            todo = []
            for i, f in enumerate(self.files):
                dir_fd, name = self._place(f)
                if self._already_verified(f, dir_fd, name, journal):
                    self.report.skipped.append(f.path)
                else:
                    todo.append((i, f, dir_fd, name))
            self._download(todo)
        except OSError as exc:
            raise FetchError(f"{self.dest}: {exc.strerror or exc} ({exc.filename or 'local disk'})") from exc
        finally:
            self._close_state()
            self.report.seconds = time.monotonic() - start
        return self.report

    def _download(self, todo: list[tuple[int, ManifestFile, int, str]]) -> None:
        if not todo:
            return
        self._remaining = len(todo)
        jobs: list[_FileJob] = []
        try:
            self._schedule(todo, jobs)
        finally:  # the pool has finished: no thread writes any more
            for job in jobs:
                job.close()
                if self._failed:  # a failed fetch leaves only verified files
                    self._unlink_part(job)
        if self._failed:
            raise self._failed

    def _unlink_part(self, job: _FileJob) -> None:
        try:
            os.unlink(job.part_name, dir_fd=self._parts_fd)
        except FileNotFoundError:
            pass

    def _schedule(self, todo: list[tuple[int, ManifestFile, int, str]], jobs: list[_FileJob]) -> None:
        with ThreadPoolExecutor(self.opts.workers, thread_name_prefix="model-fetch") as pool:
            for i, f, dir_fd, name in todo:
                part_name = f"{i}.part"
                part = self.state / "parts" / part_name
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                try:  # parts/ was emptied: anything there now was planted, and is not followed
                    fd = os.open(part_name, flags, 0o644, dir_fd=self._parts_fd)
                except FileExistsError as exc:
                    raise FetchError(
                        f"{part}: appeared while fetching (another fetch into {self.dest}?); "
                        "fetch again once it has ended",
                    ) from exc
                chunks = max(1, -(-f.size // self.opts.chunk_bytes))
                job = _FileJob(i, f, self.dest / f.path, dir_fd, name, part, part_name, fd, chunks)
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
        mtime_ns = os.fstat(job.fd).st_mtime_ns  # a rename keeps it
        job.close()
        got = job.hasher.hexdigest()
        if got != f.sha256:
            self._unlink_part(job)
            raise FetchError(
                f"{f.path}: sha256 {got} of {self.uri(f)} is not the manifest's {f.sha256}; "
                "the object is corrupt or the manifest stale: re-upload both",
                EXIT_MISMATCH,
            )
        # rename(2) replaces the name in a real folder, never what a link there points to.
        os.replace(job.part_name, job.name, src_dir_fd=self._parts_fd, dst_dir_fd=job.dir_fd)
        os.fsync(job.dir_fd)
        assert self.journal is not None
        self.journal.record(f, mtime_ns)
        with self._count_lock:
            self.report.fetched.append(f.path)
            self._remaining -= 1
            if self._remaining == 0:
                self._all_done.set()


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
