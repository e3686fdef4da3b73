"""``POST /v1/files``: a multipart body streamed straight into the file store.

The body is parsed as it arrives (python-multipart's streaming parser); the
file part goes to the store in ~1 MiB writes (local: a temp file renamed at the
end; S3: 8 MiB multipart parts), so an upload costs bounded memory whatever its
size. The writes run on their own thread behind a queue of at most
``QUEUE_CHUNKS`` MiB, so the body keeps arriving while an S3 part uploads (done
in turn, receiving and uploading add up: bench/batch_api.py went from 41 to
56 MB/s on a loaded machine, 0.5x → 0.8x of boto3's own upload_file).
The size limit is enforced while streaming: the first byte over it aborts the
write (nothing is published) and answers 413.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from python_multipart.multipart import MultipartParser, parse_options_header

from aibrix_operators.batch_api.errors import ApiError, bad_request
from aibrix_operators.batch_api.files import FileStore, StoredFile, now
from aibrix_operators.batch_api.ids import check_filename, new_file_id

WRITE_CHUNK = 1 << 20
# Writes waiting for the writer thread (~1 MiB each): receiving goes on through half of an 8 MiB
# S3 part upload. 8 measured no faster here and added ~6 MB to the api-server's peak RSS.
QUEUE_CHUNKS = 4
MAX_FIELD_BYTES = 1024
# A batch upload has two parts (file, purpose); the SDK may add a few. Each part costs parser
# callbacks on the event loop, so their number and their headers are bounded too.
MAX_PARTS = 16
MAX_PART_HEADER_BYTES = 8 * 1024
ACCEPTED_PURPOSES = ("batch",)


class _Parts:
    """Collects small form fields in memory and hands the ``file`` part's bytes to a sink."""

    def __init__(self) -> None:
        self.fields: dict[str, bytes] = {}
        self.filename: str | None = None
        self.saw_file = False
        self.pending: list[bytes] = []  # file bytes parsed but not yet written
        self.pending_bytes = 0
        self.file_bytes = 0
        self._headers: dict[bytes, bytes] = {}
        self._field = b""
        self._value = b""
        self._name: str | None = None
        self._is_file = False
        self._parts = 0
        self._header_bytes = 0

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin, "on_header_field": self._hfield,
            "on_header_value": self._hvalue, "on_header_end": self._hend,
            "on_headers_finished": self._hdone, "on_part_data": self._data,
        }

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise bad_request(f"a batch upload has at most {MAX_PARTS} form parts (file and purpose)")
        self._headers, self._field, self._value = {}, b"", b""
        self._name, self._is_file, self._header_bytes = None, False, 0

    def _header_data(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_PART_HEADER_BYTES:
            raise bad_request(f"a form part's headers exceed {MAX_PART_HEADER_BYTES} bytes")

    def _hfield(self, data: bytes, start: int, end: int) -> None:
        self._header_data(end - start)
        self._field += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._header_data(end - start)
        self._value += data[start:end]

    def _hend(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _hdone(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.saw_file:
                raise bad_request("only one file part is accepted", "file")
            self.saw_file = self._is_file = True
            raw = options.get(b"filename")
            self.filename = raw.decode("utf-8", "replace") if raw is not None else "upload.jsonl"
        else:
            self.fields.setdefault(self._name, b"")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            chunk = bytes(data[start:end])
            self.pending.append(chunk)
            self.pending_bytes += len(chunk)
            self.file_bytes += len(chunk)
        elif self._name is not None:
            value = self.fields[self._name] + data[start:end]
            if len(value) > MAX_FIELD_BYTES:
                raise bad_request(f"form field {self._name!r} is too long", self._name)
            self.fields[self._name] = value


class _WriterThread:
    """Writes ``fh`` on a thread of its own, in order, while the caller keeps receiving."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=QUEUE_CHUNKS)
        self._error: BaseException | None = None
        self._discard = False
        self._thread = threading.Thread(target=self._run, name="batch-api-upload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None and not self._discard:
                try:
                    self._fh.write(data)
                except BaseException as exc:  # noqa: BLE001 - handed to the receiving side
                    self._error = exc

    async def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        try:
            self._queue.put_nowait(data)
        except queue.Full:  # the store is slower than the client: wait off the event loop
            await anyio.to_thread.run_sync(self._queue.put, data)

    def _finish(self) -> None:
        self._queue.put(None)
        self._thread.join()

    async def close(self, discard: bool = False) -> None:
        """Wait until every queued write is done (or skipped, if ``discard``); raise its error."""
        self._discard = self._discard or discard
        await anyio.to_thread.run_sync(self._finish)
        if self._error is not None and not discard:
            raise self._error


async def receive_upload(
    body: AsyncIterator[bytes], content_type: str, store: FileStore, tenant: str, max_bytes: int,
) -> StoredFile:
    """Stream a ``multipart/form-data`` body (fields ``file``, ``purpose``) into the store."""
    ctype, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise bad_request("the body must be multipart/form-data with a 'file' and a 'purpose' field")
    parts = _Parts()
    parser = MultipartParser(boundary, parts.callbacks())
    file_id = new_file_id()
    uri = store.content_uri(tenant, file_id)
    writer_cm = store.storage.open_write(uri)
    fh = await anyio.to_thread.run_sync(writer_cm.__enter__)
    writer = _WriterThread(fh)
    try:
        async for chunk in body:
            parser.write(chunk)
            if parts.file_bytes > max_bytes:
                raise ApiError(413, f"file exceeds the maximum size of {max_bytes} bytes",
                               "file_too_large", "file")
            if parts.pending_bytes >= WRITE_CHUNK:
                data, parts.pending, parts.pending_bytes = b"".join(parts.pending), [], 0
                await writer.write(data)
        parser.finalize()
        if not parts.saw_file:
            raise bad_request("missing required field 'file'", "file", "missing_required_parameter")
        purpose = parts.fields.get("purpose", b"").decode("utf-8", "replace")
        if purpose not in ACCEPTED_PURPOSES:
            raise bad_request(f"purpose must be one of {list(ACCEPTED_PURPOSES)}, got {purpose[:40]!r}",
                              "purpose", "invalid_purpose")
        filename = check_filename(parts.filename or "")
        if purpose == "batch" and not filename.lower().endswith(".jsonl"):
            # OpenAI's own check and message: a Batch API input is a .jsonl file.
            raise bad_request("Invalid file format for Batch API. Must be .jsonl", "file",
                              "invalid_file_format")
        if parts.file_bytes == 0:
            raise bad_request("the file is empty", "file", "empty_file")
        if parts.pending:
            await writer.write(b"".join(parts.pending))
            parts.pending = []
        await writer.close()
    except BaseException as exc:
        # Abort: the temp file / multipart upload is discarded, nothing is published
        # (shielded: a cancelled request must still stop its writer and abort the upload).
        with anyio.CancelScope(shield=True):
            await writer.close(discard=True)
            await anyio.to_thread.run_sync(writer_cm.__exit__, type(exc), exc, exc.__traceback__)
        if isinstance(exc, ApiError | anyio.get_cancelled_exc_class()):
            raise
        if type(exc).__module__.startswith("python_multipart"):
            raise bad_request(f"malformed multipart body: {exc}") from None
        raise
    await anyio.to_thread.run_sync(writer_cm.__exit__, None, None, None)
    stored = StoredFile(id=file_id, bytes=parts.file_bytes, created_at=now(), filename=filename,
                        purpose=purpose, content_uri=uri)
    await anyio.to_thread.run_sync(store.save_meta, tenant, stored)
    return stored
