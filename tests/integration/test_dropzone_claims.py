"""The drop zone's claim logic against a real S3 server (SeaweedFS): each (name, content) starts
one batch, however often it is seen or re-uploaded."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid

import pytest
from botocore.exceptions import ClientError

from aibrix_operators.batch.records import longest_key_bytes, work_prefix
from aibrix_operators.dropzone.core import (
    DropZone,
    InboxObject,
    claim,
    find_new,
    key_length_problem,
    record,
    run_id_for,
)
from aibrix_operators.triggers.dropzone import DropZoneTrigger
from tests.integration.conftest import TEST_BUCKET

pytestmark = pytest.mark.service

A = b'{"custom_id": "a"}\n'
B = b'{"custom_id": "b"}\n'


@pytest.fixture
def s3(s3_server):
    client = s3_server.ensure_bucket(TEST_BUCKET)
    return client


@pytest.fixture
def zone():
    root = f"s3://{TEST_BUCKET}/claims-{uuid.uuid4().hex[:8]}"
    return DropZone.parse(f"{root}/inbox/", f"{root}/outbox/")


def put(s3, zone: DropZone, name: str, body: bytes, multipart: bool = False) -> None:
    key = zone.inbox[len(f"s3://{TEST_BUCKET}/"):] + name
    if not multipart:
        s3.put_object(Bucket=TEST_BUCKET, Key=key, Body=body)
        return
    upload = s3.create_multipart_upload(Bucket=TEST_BUCKET, Key=key)["UploadId"]
    part = s3.upload_part(Bucket=TEST_BUCKET, Key=key, UploadId=upload, PartNumber=1, Body=body)
    s3.complete_multipart_upload(Bucket=TEST_BUCKET, Key=key, UploadId=upload,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})


def get(s3, uri: str) -> bytes:
    return s3.get_object(Bucket=TEST_BUCKET, Key=uri[len(f"s3://{TEST_BUCKET}/"):])["Body"].read()


def claim_all(s3, zone: DropZone) -> list:
    """One pass of the DAG: claim what is new, 'start' and record the new claims."""
    outcomes = [claim(s3, zone, obj) for obj in find_new(s3, zone)]
    for outcome in outcomes:
        if outcome.claim is not None:
            record(s3, zone, outcome.claim)
    return outcomes


def test_a_drop_is_claimed_once_with_a_snapshot_of_what_was_hashed(s3, zone):
    put(s3, zone, "a.jsonl", A)
    [first] = claim_all(s3, zone)
    assert first.status == "new" and first.sha256 == hashlib.sha256(A).hexdigest()
    c = first.claim
    assert c.output_uri == zone.outbox + "a.jsonl" and get(s3, c.input_uri) == A
    record_body = json.loads(get(s3, zone.claim_uri("a.jsonl", c.sha256)))
    assert record_body["run_id"] == c.run_id and record_body["source_uri"] == zone.inbox + "a.jsonl"
    # Seen again (the next poll): nothing new, nothing hashed.
    assert find_new(s3, zone) == [] and claim_all(s3, zone) == []


def test_same_content_re_uploaded_starts_nothing_whatever_its_etag(s3, zone):
    put(s3, zone, "a.jsonl", A)
    [first] = claim_all(s3, zone)
    put(s3, zone, "a.jsonl", A)  # single PUT: same ETag (MD5), same version → not even listed as new
    assert find_new(s3, zone) == []
    put(s3, zone, "a.jsonl", A, multipart=True)  # same bytes, multipart ETag "...-1"
    [listed] = find_new(s3, zone)
    assert listed.etag != first.obj.etag and listed.etag.endswith("-1")
    [again] = claim_all(s3, zone)
    assert again.status == "duplicate" and again.run_id == first.run_id
    assert find_new(s3, zone) == []  # the duplicate version is marked seen


def test_a_changed_file_under_the_same_name_is_a_new_batch(s3, zone):
    put(s3, zone, "a.jsonl", A)
    [first] = claim_all(s3, zone)
    put(s3, zone, "a.jsonl", B)
    [second] = claim_all(s3, zone)
    assert second.status == "new" and second.run_id != first.run_id
    assert second.claim.output_uri == first.claim.output_uri  # outbox/<name>/: the newest results
    assert get(s3, second.claim.input_uri) == B and get(s3, first.claim.input_uri) == A
    # Back to the first content: that (name, content) already had its batch.
    put(s3, zone, "a.jsonl", A, multipart=True)
    [third] = claim_all(s3, zone)
    assert third.status == "duplicate" and third.run_id == first.run_id


def test_the_same_content_under_another_name_is_its_own_batch(s3, zone):
    put(s3, zone, "a.jsonl", A)
    put(s3, zone, "copy/a.jsonl", A)
    outcomes = claim_all(s3, zone)
    assert [o.status for o in outcomes] == ["new", "new"]
    assert len({o.run_id for o in outcomes}) == 2
    assert outcomes[0].claim.input_uri == outcomes[1].claim.input_uri  # one snapshot per content


def test_claimed_twice_before_recording_gives_the_same_run(s3, zone):
    """A pass that died after starting the run but before recording it: the next pass claims the
    object again with the same run id, which Airflow creates only once."""
    put(s3, zone, "a.jsonl", A)
    [obj] = find_new(s3, zone)
    one, two = claim(s3, zone, obj), claim(s3, zone, obj)
    assert one.status == two.status == "new" and one.run_id == two.run_id
    record(s3, zone, one.claim)
    record(s3, zone, two.claim)  # a second record keeps the first
    assert json.loads(get(s3, zone.claim_uri("a.jsonl", one.sha256)))["claimed_at"] == one.claim.claimed_at


def test_an_object_replaced_after_listing_is_left_for_its_next_version(s3, zone):
    put(s3, zone, "a.jsonl", A)
    [listed] = find_new(s3, zone)
    put(s3, zone, "a.jsonl", B)  # overwritten between the poll and the claim
    assert claim(s3, zone, listed).status == "changed"
    [now] = find_new(s3, zone)
    assert now.etag != listed.etag and claim(s3, zone, now).sha256 == hashlib.sha256(B).hexdigest()
    gone = InboxObject("deleted.jsonl", listed.etag, listed.size)
    assert claim(s3, zone, gone).status == "changed"


def test_hidden_and_temporary_objects_are_ignored(s3, zone):
    for name in ("_SUCCESS", ".a.jsonl.part", "tmp/_staging/x.jsonl"):
        put(s3, zone, name, A)
    assert find_new(s3, zone) == []


def _first_event(trigger: DropZoneTrigger) -> dict:
    async def first() -> dict:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(first())


def test_the_trigger_fires_for_unhandled_versions_and_reports_an_unreadable_inbox(
    s3, s3_server, zone, monkeypatch
):
    conn = s3_server.airflow_connection()
    monkeypatch.setenv("AIRFLOW_CONN_DZ_S3", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW_CONN_DZ_WRONG", json.dumps({**conn, "password": "bad-secret-7f3a"}))

    def trigger(conn_id: str, timeout_s: float) -> DropZoneTrigger:
        return DropZoneTrigger(zone.inbox, zone.outbox, conn_id, poll_interval_s=0.2,
                               timeout_s=timeout_s, max_files=10)

    assert _first_event(trigger("dz_s3", 0.5)) == {"status": "timeout", "error": None}  # empty inbox
    put(s3, zone, "a.jsonl", A)
    put(s3, zone, "_SUCCESS", b"")
    event = _first_event(trigger("dz_s3", 30))
    assert event == {"status": "found", "objects": [
        {"name": "a.jsonl", "etag": hashlib.md5(A).hexdigest(), "size": len(A)}]}  # noqa: S324
    claim_all(s3, zone)
    assert _first_event(trigger("dz_s3", 0.5)) == {"status": "timeout", "error": None}
    failed = _first_event(trigger("dz_wrong", 0.5))
    assert failed["status"] == "timeout" and "SignatureDoesNotMatch" in failed["error"], failed
    assert "bad-secret-7f3a" not in failed["error"]  # the error names no secret


def test_a_drop_beyond_the_copy_limit_is_read_in_place(s3, zone, monkeypatch):
    from aibrix_operators.dropzone import core

    monkeypatch.setattr(core, "COPY_LIMIT_BYTES", len(A) - 1)  # stands for S3's 5 GiB
    put(s3, zone, "big.jsonl", A)
    [outcome] = claim_all(s3, zone)
    assert outcome.status == "new" and outcome.claim.input_uri == zone.inbox + "big.jsonl"
    assert s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=_key_of(zone.state + "inputs/")).get("KeyCount") == 0


def _key_of(uri: str) -> str:
    return uri[len(f"s3://{TEST_BUCKET}/"):]


CONTROL_NAMES = ["a\tb.jsonl", "a\rb.jsonl", "a\nb.jsonl", "x\x7f.jsonl", "y\x01.jsonl", "tab\t/z.jsonl"]


def test_names_storage_cannot_address_are_never_claimed_and_block_nothing(s3, s3_server, zone, monkeypatch,
                                                                          caplog):
    # Issue 19, finding 4: urlparse dropped TAB/CR/LF on every access, so "a\tb.jsonl" was read
    # as "ab.jsonl", two such drops shared one results folder, and max_files of them starved
    # every legitimate drop. Now they are left out (with one warning each) and the others go on.
    for name in CONTROL_NAMES:
        put(s3, zone, name, B)
    put(s3, zone, "ab.jsonl", A)
    put(s3, zone, "good.jsonl", A)
    conn = s3_server.airflow_connection()
    monkeypatch.setenv("AIRFLOW_CONN_DZ_S3", json.dumps(conn))
    trigger = DropZoneTrigger(zone.inbox, zone.outbox, "dz_s3", poll_interval_s=0.2, timeout_s=30,
                              max_files=2)
    event = _first_event(trigger)  # max_files=2 of 8 objects: the two addressable ones fit
    assert [o["name"] for o in event["objects"]] == ["ab.jsonl", "good.jsonl"], event
    outcomes = claim_all(s3, zone)
    assert sorted(o.obj.name for o in outcomes) == ["ab.jsonl", "good.jsonl"]
    assert all(o.status == "new" for o in outcomes)
    assert get(s3, outcomes[0].claim.input_uri) == A  # "ab.jsonl" is read as itself
    assert find_new(s3, zone) == []  # nothing left that could ever be claimed
    warned = [r.getMessage() for r in caplog.records if "control characters" in r.getMessage()]
    assert len(warned) == len(CONTROL_NAMES), warned  # each reported once, however often listed


def _segment_key(work: str) -> str:
    """The key of a driver's checkpoint segment under a run's work prefix (batch/shard_results.py)."""
    return _key_of(work) + "/results/shard-00000/" + "0" * 24 + "/seg-" + "1" * 20 + "-abcdef01-000001.jsonl"


def test_a_drop_whose_batch_keys_would_pass_s3s_limit_is_refused_before_any_copy(s3, zone, caplog):
    # Issue 24: a 996-character name fits the inbox (its key is 1,018 bytes), but its batch
    # would write keys of over 1,200 bytes under outbox/<name>/_work/<run id>/results/..., which
    # the store refuses (KeyTooLongError, shown below): it used to be claimed, snapshotted and
    # started, and fail late. Now it is left out of the listing, and a claim of it is refused
    # before anything is read; the drop beside it goes on. (SeaweedFS also caps each path
    # segment at 255 bytes, so the long name is made of several.)
    name = "/".join(["d" * 240] * 4) + "/" + "r" * 26 + ".jsonl"
    assert len(name) == 996
    put(s3, zone, name, A)
    put(s3, zone, "fine.jsonl", B)
    assert [o.name for o in find_new(s3, zone)] == ["fine.jsonl"]
    [entry] = s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=_key_of(zone.inbox + "d"))["Contents"]
    outcome = claim(s3, zone, InboxObject(name, entry["ETag"].strip('"'), entry["Size"]))
    assert outcome.status == "refused" and outcome.claim is None
    assert "over S3's limit of 1024 bytes" in outcome.reason and "a name that much shorter" in outcome.reason
    assert "not starting a batch" in caplog.text
    # Nothing was snapshotted, claimed or marked seen for it.
    assert s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=_key_of(zone.state)).get("KeyCount") == 0
    [fine] = claim_all(s3, zone)
    assert fine.status == "new" and fine.obj.name == "fine.jsonl"
    # What the batch would have met: a checkpoint segment's key under its work prefix.
    work = work_prefix(zone.output_uri(name), run_id_for(name, hashlib.sha256(A).hexdigest()))
    segment = _segment_key(work)
    assert len(segment.encode()) == longest_key_bytes(work) > 1024
    with pytest.raises(ClientError, match="KeyTooLong"):
        s3.put_object(Bucket=TEST_BUCKET, Key=segment, Body=b"x")


def test_the_longest_output_the_bound_accepts_is_one_the_store_takes(s3, zone):
    # The other side of the bound: a name whose batch's longest key is exactly 1,024 bytes is
    # accepted, and the store takes a key of that length.
    def longest(name: str) -> int:
        return longest_key_bytes(work_prefix(zone.output_uri(name), run_id_for(name, "0" * 64)))

    stem = "/".join(["e" * 200] * 3) + "/"
    name = stem + "f" * (1 + 1024 - longest(stem + "f"))  # one byte more, one more in longest()
    assert longest(name) == 1024 and key_length_problem(zone, name) is None
    assert key_length_problem(zone, name + "g") is not None
    work = work_prefix(zone.output_uri(name), run_id_for(name, "0" * 64))
    segment = _segment_key(work)
    assert len(segment.encode()) == 1024
    s3.put_object(Bucket=TEST_BUCKET, Key=segment, Body=b"x")


def test_s3_uris_are_checked_and_used_in_one_parsed_form(s3):
    # Issue 19, finding 5: "s3://b/out/\t../\t../secret/x" passed the allow-list and was sent as
    # out/../../secret/x. And "#" or "?" in a key cut it short under urlparse.
    from aibrix_operators.storage import S3Storage, StorageError
    from aibrix_operators.trust.policy import TrustPolicy, TrustViolation

    policy = TrustPolicy(endpoints=(), storage=(f"s3://{TEST_BUCKET}/out/",), aws_conn_ids=(),
                         inference_conn_ids=())  # fmt: skip
    for uri in (f"s3://{TEST_BUCKET}/out/\t../\t../secret/x", f"s3://{TEST_BUCKET}/out/\n../x",
                f"s3://{TEST_BUCKET}/out/../secret/x", f"s3://{TEST_BUCKET}\t/out/x"):  # fmt: skip
        with pytest.raises(TrustViolation, match="allowed_storage"):
            policy.check_storage(uri, "output_uri")
    storage = S3Storage(client=s3)
    s3.put_object(Bucket=TEST_BUCKET, Key="out/secret", Body=b"secret")
    with pytest.raises(StorageError, match="control characters"):
        storage.read_bytes(f"s3://{TEST_BUCKET}/out/\tsecret")
    # "#" and "?" are part of the key: the object written is the one read, not "out/a".
    policy.check_storage(f"s3://{TEST_BUCKET}/out/a#b?c", "output_uri")
    with storage.open_write(f"s3://{TEST_BUCKET}/out/a#b?c") as f:
        f.write(b"hashed")
    assert s3.get_object(Bucket=TEST_BUCKET, Key="out/a#b?c")["Body"].read() == b"hashed"
    assert storage.read_bytes(f"s3://{TEST_BUCKET}/out/a#b?c") == b"hashed"
    listed = s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix="out/a")["Contents"]
    assert "out/a" not in [o["Key"] for o in listed]
