"""Failures before validation: specific codes, a failed batch.json, or a log line saying why not."""

from __future__ import annotations

import json

from botocore.exceptions import ClientError, NoCredentialsError

from aibrix_operators.batch.failures import one_line, storage_error_code
from aibrix_operators.batch.job import validate_batch
from aibrix_operators.storage import StorageError


def test_missing_input_is_recorded_with_its_own_code(storage, tmp_path):
    out = tmp_path / "out"
    report, batch = validate_batch(storage, str(tmp_path / "absent.jsonl"), str(out), batch_id="batch_x")
    assert batch is None
    assert [(e.code, e.param) for e in report.errors] == [("input_not_found", "input_uri")]
    assert report.record.written and report.record.uri == f"{out}/batch.json"
    written = json.loads((out / "batch.json").read_text())
    assert (written["id"], written["status"]) == ("batch_x", "failed")
    assert written["errors"]["data"][0]["code"] == "input_not_found"
    assert "absent.jsonl" in written["errors"]["data"][0]["message"]
    assert "Traceback" not in written["errors"]["data"][0]["message"]


def test_an_unwritable_output_is_reported_not_raised(storage, write_file, tmp_path, lines):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    report, batch = validate_batch(storage, str(tmp_path / "absent.jsonl"), str(blocker / "out"))
    assert batch is None and not report.record.written
    expected = f"batch.json could not be written to {blocker}/out/batch.json: "
    assert report.record.describe().startswith(expected)
    # Content errors take the same path.
    report, _ = validate_batch(storage, write_file(b"{oops\n"), str(blocker / "out"))
    assert [e.code for e in report.errors] == ["invalid_json_line"] and not report.record.written


def test_storage_error_codes_follow_the_cause():
    def wrapped(cause: BaseException) -> StorageError:
        try:
            raise StorageError("cannot read x") from cause
        except StorageError as exc:
            return exc

    def client_error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}}, "GetObject")

    assert storage_error_code(wrapped(FileNotFoundError(2, "no"))) == "input_not_found"
    assert storage_error_code(wrapped(PermissionError(13, "no"))) == "input_access_denied"
    assert storage_error_code(wrapped(client_error("NoSuchKey"))) == "input_not_found"
    assert storage_error_code(wrapped(client_error("NoSuchBucket"))) == "input_not_found"
    for denied in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        assert storage_error_code(wrapped(client_error(denied))) == "input_access_denied"
    assert storage_error_code(NoCredentialsError()) == "input_access_denied"
    assert storage_error_code(wrapped(client_error("SlowDown"))) == "input_unreadable"
    assert storage_error_code(StorageError("x")) == "input_unreadable"


def test_messages_are_one_bounded_line():
    assert one_line("a\n  b\tc") == "a b c"
    assert len(one_line("x" * 10_000)) == 1003
