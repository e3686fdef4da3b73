"""Batch API core without Airflow or a server: ids, keys, request rules, status mapping, uploads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from aibrix_operators.batch_api.auth import authenticate, key_digest, parse_keyring
from aibrix_operators.batch_api.batches import check_metadata, check_window, route_for
from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.files import FileStore, StoredFile
from aibrix_operators.batch_api.ids import (
    check_batch_id,
    check_file_id,
    check_filename,
    check_tenant,
    new_batch_id,
    new_file_id,
)
from aibrix_operators.batch_api.settings import ApiSettings, parse_models
from aibrix_operators.batch_api.status import RunSnapshot, TaskState, batch_object, batch_status
from aibrix_operators.batch_api.upload import receive_upload
from aibrix_operators.storage import LocalStorage
from tests.batch_api_uploads import assert_hidden_from, chunks, multipart


def test_ids_are_strict_and_sort_by_age():
    a = new_file_id()
    time.sleep(0.002)  # ids order by millisecond
    b = new_file_id()
    assert check_file_id(a) == a and a <= b
    assert new_batch_id("t", "k") == new_batch_id("t", "k") != new_batch_id("u", "k")
    for bad in ("..", "file-../x", "/etc/passwd", "file-" + "０" * 32, "file-" + "0" * 31 + "\x00", ""):
        with pytest.raises(ApiError) as exc:
            check_file_id(bad)
        assert exc.value.status == 400
    with pytest.raises(ApiError):
        check_batch_id("batch_../../x")


@pytest.mark.parametrize("name", ["..", "a/b", "a\\b", "../x", "a\x00b", "a\tb", "a\u202eb",
                                  "a\u200bb", "e\u0301", "x" * 256, ""])
def test_odd_filenames_are_refused(name):
    with pytest.raises(ApiError) as exc:
        check_filename(name)
    assert exc.value.status == 400


def test_keys_are_digests_and_bad_keys_are_401():
    ring = parse_keyring(json.dumps({key_digest("sk-a"): "alpha", "sha256:" + key_digest("sk-b"): "beta"}))
    assert authenticate("Bearer sk-a", ring) == "alpha" and authenticate("bearer sk-b", ring) == "beta"
    for header in (None, "", "Bearer", "Basic sk-a", "Bearer sk-c"):
        with pytest.raises(ApiError) as exc:
            authenticate(header, ring)
        assert exc.value.status == 401 and "sk-" not in exc.value.message
    with pytest.raises(ValueError, match="digests"):
        parse_keyring(json.dumps({"sk-raw-key": "alpha"}))
    with pytest.raises(ValueError):
        parse_keyring(json.dumps({key_digest("x"): "Bad_Tenant"}))


def test_request_rules():
    assert check_window("24h") == 86400 and check_window("90m") == 5400
    for bad in ("tomorrow", "0h", "24", "-1h", "1000h", ""):
        with pytest.raises(ApiError):
            check_window(bad)
    assert check_metadata({"k" * 64: "v" * 512}) == {"k" * 64: "v" * 512}
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, []):
        with pytest.raises(ApiError):
            check_metadata(bad)
    settings = ApiSettings("/r", models=parse_models("a=http://127.0.0.1:1, b=conn:vllm"))
    assert route_for(settings, "b")[1].dag_params() == {"inference_conn_id": "vllm", "endpoint": ""}
    with pytest.raises(ApiError, match="a, b"):
        route_for(settings, "gpt-4o")
    # A LoRA adapter of the registry goes where its base goes; the batch's model is the base.
    model, route = route_for(settings, "b-sql-lora", {"b-sql-lora": "b", "x-lora": "x"})
    assert (model, route.dag_params()) == ("b", {"inference_conn_id": "vllm", "endpoint": ""})
    with pytest.raises(ApiError, match="'x-lora' is not served here"):
        route_for(settings, "x-lora", {"x-lora": "x"})  # its base is not on offer


def _snap(run_state="running", **tasks) -> RunSnapshot:
    conf = {"completion_window": "1h", "batch_endpoint": "/v1/chat/completions",
            "openai_batch": {"input_file_id": "file-x", "created_at": 100}}
    return RunSnapshot("batch_" + "0" * 32, conf, run_state,
                       {k: [TaskState(s, 1, 2) for s in v] for k, v in tasks.items()})


def test_status_mapping():
    assert batch_status(_snap("queued")) == "validating"
    assert batch_status(_snap(validate=["running"])) == "validating"
    assert batch_status(_snap(validate=["success"], dispatch=["running", "success"])) == "in_progress"
    assert batch_status(_snap(validate=["success"], dispatch=["success"], merge=["running"])) == "finalizing"
    cancelling = _snap(validate=["success"], dispatch=["running"])
    cancelling.cancel_at = 5
    assert batch_status(cancelling) == "cancelling"
    done = _snap("success")
    done.batch_json = {"status": "cancelled", "cancelled_at": 9, "output_file_id": "/o",
                       "error_file_id": "/e", "request_counts": {"total": 3, "completed": 1, "failed": 2},
                       "aibrix_unanswered": 2}
    obj = batch_object(done)
    assert obj["status"] == "cancelled" and obj["cancelled_at"] == 9
    assert obj["aibrix_unanswered"] == 2  # of failed, left unanswered by the cancel
    assert obj["output_file_id"].endswith("-output") and obj["error_file_id"].endswith("-errors")
    assert obj["expires_at"] == 100 + 3600 and obj["input_file_id"] == "file-x"
    # Issue 19, finding 15: cancelled or expired with nothing completed: no output file id.
    for status in ("cancelled", "expired"):
        done.batch_json = {"status": status, "output_file_id": "/o", "error_file_id": "/e",
                           "request_counts": {"total": 3, "completed": 0, "failed": 3}}
        obj = batch_object(done)
        assert obj["output_file_id"] is None and obj["error_file_id"].endswith("-errors"), obj
    failed = _snap("failed")
    failed.batch_json = {"status": "failed", "errors": {"data": [
        {"code": "invalid_json_line", "line": 2, "message": "m", "param": None, "task": "x"}]}}
    obj = batch_object(failed)
    assert obj["errors"]["data"] == [{"code": "invalid_json_line", "line": 2, "message": "m", "param": None}]
    assert batch_object(_snap("failed"))["errors"]["data"][0]["code"] == "batch_run_failed"
    failed.conf["input_uri"] = "/srv/root/tenants/alpha/files/file-x.jsonl"
    failed.batch_json["errors"]["data"][0]["message"] = "cannot read " + failed.conf["input_uri"]
    assert batch_object(failed)["errors"]["data"][0]["message"] == "cannot read file-x"
    # Issue 19, finding 13: the deployment's addresses never reach a tenant; the code stays.
    failed.batch_json["errors"]["data"][0].update(
        code="endpoint_unavailable",
        message="cannot reach the inference endpoint http://127.0.0.1:37011 (ClientConnectorError: "
                "Cannot connect to host 10.0.3.7:8000 ssl:default); s3://internal-bucket/x failed")
    [item] = batch_object(failed)["errors"]["data"]
    assert item["code"] == "endpoint_unavailable"
    assert item["message"] == (
        "cannot reach the inference endpoint <internal address> (ClientConnectorError: "
        "Cannot connect to host <internal address> ssl:default); <internal address> failed")
    live = _snap(validate=["success"], dispatch=["running"])
    live.live_counts = (10, 4, 1)
    assert batch_object(live)["request_counts"] == {"total": 10, "completed": 3, "failed": 1}


def test_upload_streams_and_oversize_publishes_nothing(tmp_path):
    store = FileStore(LocalStorage(), str(tmp_path))
    payload = b'{"custom_id": "a"}\n' * 5000
    body, ctype = multipart(payload)
    stored = asyncio.run(receive_upload(chunks(body), ctype, store, "alpha", len(payload)))
    assert stored.bytes == len(payload)
    assert b"".join(store.open_content("alpha", stored.id)) == payload
    with pytest.raises(ApiError) as exc:
        asyncio.run(receive_upload(chunks(body), ctype, store, "alpha", len(payload) - 1))
    assert exc.value.status == 413
    files = sorted(p.name for p in (tmp_path / "tenants" / "alpha" / "files").iterdir())
    assert files == [stored.id + ".json", stored.id + ".jsonl"]  # no second file, no temp left
    for bad_body, bad_type in (multipart(payload, purpose="fine-tune"), (body, "application/json")):
        with pytest.raises(ApiError) as exc:
            asyncio.run(receive_upload(chunks(bad_body), bad_type, store, "alpha", 10**7))
        assert exc.value.status == 400


class _FailingWrites(LocalStorage):
    """Local storage whose writes fail after ``limit`` bytes (a store that breaks mid-upload)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    @contextlib.contextmanager
    def open_write(self, uri):
        with super().open_write(uri) as fh:
            written = [0]

            class Fh:
                def write(self, data):
                    written[0] += len(data)
                    if written[0] > limit:
                        raise OSError("the store is full")
                    return fh.write(data)

            limit = self.limit
            yield Fh()


def test_upload_writes_in_order_off_the_event_loop_and_a_store_failure_publishes_nothing(tmp_path):
    # Several MiB: the writes go through the writer thread's queue, and must land in order.
    payload = b"".join(b'{"custom_id": "r%07d"}\n' % i for i in range(200_000))
    body, ctype = multipart(payload)
    store = FileStore(LocalStorage(), str(tmp_path / "ok"))
    stored = asyncio.run(receive_upload(chunks(body, 65536), ctype, store, "alpha", 10**8))
    assert b"".join(store.open_content("alpha", stored.id)) == payload
    broken = FileStore(_FailingWrites(2 << 20), str(tmp_path / "broken"))
    with pytest.raises(OSError, match="full"):
        asyncio.run(receive_upload(chunks(body, 65536), ctype, broken, "alpha", 10**8))
    assert not list((tmp_path / "broken").rglob("*.json*"))  # no content, no meta, no temp file


def test_file_store_keeps_tenants_apart(tmp_path):
    store = FileStore(LocalStorage(), str(tmp_path))
    body, ctype = multipart(b"{}\n")
    stored = asyncio.run(receive_upload(chunks(body), ctype, store, "alpha", 100))
    assert_hidden_from(store, "beta", stored.id)
    # A meta object pointing outside the tenant's prefix is treated as missing.
    evil = StoredFile(new_file_id(), 1, 1, "x", "batch", str(tmp_path / "tenants" / "beta" / "x"))
    with pytest.raises(ValueError):
        store.save_meta("alpha", evil)


@pytest.mark.parametrize("suffix", ["\n", "\r\n", "\r", "\t", " "])
def test_ids_with_a_trailing_newline_or_space_are_refused_everywhere(tmp_path, suffix):
    # Issue 19, finding 11: "$" matched before a trailing newline, and S3 drops the newline, so
    # the id aliased the real file. The real file stays reachable by its own id.
    store = FileStore(LocalStorage(), str(tmp_path))
    body, ctype = multipart(b"{}\n")
    stored = asyncio.run(receive_upload(chunks(body), ctype, store, "alpha", 100))
    for check in (lambda: check_file_id(stored.id + suffix), lambda: store.get("alpha", stored.id + suffix),
                  lambda: store.list("alpha", stored.id + suffix, 10, "desc", None),
                  lambda: check_batch_id(new_batch_id("alpha") + suffix)):  # fmt: skip
        with pytest.raises(ApiError) as exc:
            check()
        assert exc.value.status == 400
    with pytest.raises(ValueError):
        check_tenant("alpha" + suffix)
    assert store.get("alpha", stored.id).id == stored.id


@pytest.mark.parametrize("name", ["input.txt", "input.json", "input", "input.jsonl.txt", "jsonl"])
def test_a_batch_upload_must_be_a_jsonl_file_and_publishes_nothing(tmp_path, name):
    # Issue 19, finding 16: OpenAI answers 400 for anything but .jsonl with purpose=batch.
    store = FileStore(LocalStorage(), str(tmp_path))
    body, ctype = multipart(b'{"custom_id": "a"}\n', name=name)
    with pytest.raises(ApiError) as exc:
        asyncio.run(receive_upload(chunks(body), ctype, store, "alpha", 1000))
    assert (exc.value.status, exc.value.message) == (400, "Invalid file format for Batch API. Must be .jsonl")
    assert store.list("alpha", None, 10, "desc", None) == ([], False)
    body, ctype = multipart(b'{"custom_id": "a"}\n', name="Input.JSONL")  # the well-formed upload succeeds
    assert asyncio.run(receive_upload(chunks(body), ctype, store, "alpha", 1000)).filename == "Input.JSONL"


def test_timestamps_are_set_with_their_status_and_never_move():
    """Found by AIBrix's tests: finalizing_at was null while the merge task waited for a slot,
    and in_progress_at moved from validation's end to the first shard's start at the end."""
    queued_merge = _snap(validate=["success"], dispatch=["success", "success"], merge=["queued"])
    queued_merge.tasks["dispatch"] = [TaskState("success", 3, 7), TaskState("success", 3, 8)]
    queued_merge.tasks["merge"] = [TaskState("queued", None, None)]
    obj = batch_object(queued_merge)
    assert obj["status"] == "finalizing" and obj["finalizing_at"] == 8
    started = _snap(validate=["success"], dispatch=["success"], merge=["running"])
    started.tasks["merge"] = [TaskState("running", 9, None)]
    assert batch_object(started)["finalizing_at"] == 9
    live = _snap(validate=["success"], dispatch=["running"])
    live.tasks["validate"] = [TaskState("success", 1, 2)]
    done = _snap("success", validate=["success"], dispatch=["success"], merge=["success"])
    done.tasks["validate"] = [TaskState("success", 1, 2)]
    done.batch_json = {"status": "completed", "in_progress_at": 5, "finalizing_at": 9, "completed_at": 10,
                       "request_counts": {"total": 1, "completed": 1, "failed": 0}}
    assert batch_object(live)["in_progress_at"] == batch_object(done)["in_progress_at"] == 2


def test_a_running_batch_offers_its_finished_shards_answers_until_it_ends():
    """Issue 39: the partial output is offered while the batch runs and a shard has finished;
    never before the first shard ends, never once the batch has ended (its output is final)."""
    from aibrix_operators.batch_api import extensions
    from aibrix_operators.batch_api.ids import batch_of_output_file

    running = _snap(validate=["success"], split=["success"], dispatch=["success", "running", "queued"])
    running.shard_count, running.shards_done = 3, (0,)
    shown = batch_object(running)
    partial = shown[extensions.PARTIAL_OUTPUT_FILE_ID]
    assert partial == "file-" + "0" * 32 + "-partial"
    assert batch_of_output_file(partial, "partial") == running.batch_id
    assert shown[extensions.SHARDS] == {"total": 3, "done": 1}
    running.shards_done = ()
    assert batch_object(running)[extensions.PARTIAL_OUTPUT_FILE_ID] is None  # nothing finished yet
    ended = _snap("success", validate=["success"], dispatch=["success"] * 3, merge=["success"])
    ended.shard_count, ended.shards_done, ended.batch_json = 3, (0, 1, 2), {"status": "completed"}
    shown = batch_object(ended)
    assert shown[extensions.PARTIAL_OUTPUT_FILE_ID] is None and shown[extensions.SHARDS] is None
    assert batch_of_output_file("file-abc-output", "partial") is None
