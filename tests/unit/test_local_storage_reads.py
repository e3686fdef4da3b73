"""Local inputs that are not files (a second review's variant of finding 12): never a hang."""

from __future__ import annotations

import os
import threading

import pytest

from aibrix_operators.storage import LocalStorage, StorageError


def _read_in_thread(storage: LocalStorage, uri: str) -> dict[str, object]:
    box: dict[str, object] = {}

    def read() -> None:
        try:
            box["data"] = storage.read_bytes(uri)
        except StorageError as exc:
            box["error"] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), f"reading {uri} blocked"
    return box


def test_a_fifo_or_a_device_as_input_is_a_clear_error_and_files_still_read(tmp_path) -> None:
    storage = LocalStorage()
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    box = _read_in_thread(storage, str(fifo))
    assert isinstance(box.get("error"), StorageError) and "not a regular file" in str(box["error"]), box
    box = _read_in_thread(storage, "/dev/zero")  # would stream without end
    assert "not a regular file" in str(box.get("error")), box
    (tmp_path / "ok.jsonl").write_bytes(b'{"custom_id": "a"}\n')
    assert _read_in_thread(storage, f"file://{tmp_path}/ok.jsonl")["data"] == b'{"custom_id": "a"}\n'
    with pytest.raises(StorageError, match="cannot read"):
        storage.read_bytes(str(tmp_path / "absent.jsonl"))
