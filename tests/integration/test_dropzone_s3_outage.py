"""The drop zone's claim/record bookkeeping when its S3 server (a real SeaweedFS) goes away mid-pass
and comes back: the failing call raises (it does not pass for "nothing new" or "changed"), no drop
is lost, and none gets a second batch: a drop claimed again gets the same run id, which Airflow's
start_batch (``skip_when_already_exists``) creates once.

The module runs its own SeaweedFS, not the session ``s3_server``, because the tests stop it. A
server stopped at a chosen request is stopped from a botocore hook on the real request, so the
request itself meets the dead server. The client does not retry, so an outage fails at once."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator

import pytest
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from aibrix_operators.dropzone.core import DropZone, claim, find_new, record, run_id_for
from tests.integration.services import S3Server, start_seaweedfs, stop_group

pytestmark = [pytest.mark.service, pytest.mark.waits]  # its own lane: docs/testing.md

BUCKET = "dropzone-outage"
KEY, SECRET = "outage-key", "outage-secret"
A = b'{"custom_id": "a"}\n'
B = b'{"custom_id": "b"}\n'


class Store:
    """A SeaweedFS the tests stop and restart (same data dir, same ports)."""

    def __init__(self, data_dir) -> None:
        self.data_dir = data_dir
        self.server: S3Server = start_seaweedfs(data_dir, KEY, SECRET)

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.server.endpoint, region_name="us-east-1",
            aws_access_key_id=KEY, aws_secret_access_key=SECRET,
            config=Config(connect_timeout=1, read_timeout=3, retries={"total_max_attempts": 1}),
        )

    @property
    def up(self) -> bool:
        return self.server.proc.poll() is None

    def stop(self) -> None:
        stop_group(self.server.proc)

    def restart(self) -> None:
        self.server = start_seaweedfs(self.data_dir, KEY, SECRET, ports=self.server.ports)
        # start_seaweedfs waits for the S3 API (a LIST); reads and writes fail (InternalError,
        # timeouts) until the volume server is back too. Wait for a write and read to work.
        s3, deadline = self.client(), time.monotonic() + 60
        while True:
            try:
                s3.put_object(Bucket=BUCKET, Key="probe", Body=b"up")
                if s3.get_object(Bucket=BUCKET, Key="probe")["Body"].read() == b"up":
                    return
            except (BotoCoreError, ClientError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def stop_on(self, s3, operation: str, key_part: str) -> None:
        """Stop the server when ``s3`` is about to send ``operation`` on a key/prefix containing
        ``key_part`` (once)."""
        def hook(params, **_):
            if self.up and key_part in params.get("Key", params.get("Prefix", "")):
                self.stop()

        s3.meta.events.register(f"provide-client-params.s3.{operation}", hook)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    store = Store(tmp_path_factory.mktemp("weed-outage"))
    try:
        store.client().create_bucket(Bucket=BUCKET)
        yield store
    finally:
        stop_group(store.server.proc)


@pytest.fixture
def s3(store: Store):
    if not store.up:  # a test that failed while the server was down
        store.restart()
    yield store.client()
    if not store.up:
        store.restart()


@pytest.fixture
def zone() -> DropZone:
    root = f"s3://{BUCKET}/outage-{uuid.uuid4().hex[:8]}"
    return DropZone.parse(f"{root}/inbox/", f"{root}/outbox/")


def key(uri: str) -> str:
    return uri[len(f"s3://{BUCKET}/"):]


def put(s3, zone: DropZone, name: str, body: bytes) -> None:
    s3.put_object(Bucket=BUCKET, Key=key(zone.source_uri(name)), Body=body)


def get(s3, uri: str) -> bytes:
    return s3.get_object(Bucket=BUCKET, Key=key(uri))["Body"].read()


def state_keys(s3, zone: DropZone) -> list[str]:
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=key(zone.state))
    return [o["Key"][len(key(zone.state)):] for o in listed.get("Contents", [])]


def one_pass(s3, zone: DropZone, started: list[str]) -> list:
    """One s3_dropzone run: claim what is new, ask Airflow to start each new claim's run id
    (appended to ``started``), then record the new claims."""
    outcomes = [claim(s3, zone, obj) for obj in find_new(s3, zone)]
    new = [o.claim for o in outcomes if o.claim is not None]
    started.extend(c.run_id for c in new)
    for c in new:
        record(s3, zone, c)
    return outcomes


def test_outage_between_claim_and_record_claims_again_with_the_same_run_ids(store, s3, zone):
    put(s3, zone, "a.jsonl", A)
    put(s3, zone, "b.jsonl", B)
    first = [claim(s3, zone, obj) for obj in find_new(s3, zone)]
    assert [o.status for o in first] == ["new", "new"]
    started = [o.run_id for o in first]  # start_batch created both runs; then S3 went away
    store.stop()
    with pytest.raises(EndpointConnectionError):
        record(s3, zone, first[0].claim)

    store.restart()
    s3 = store.client()
    assert sorted(state_keys(s3, zone)) == sorted(  # the snapshots; no record, no seen marker
        f"inputs/{hashlib.sha256(body).hexdigest()}.jsonl" for body in (A, B))
    second = one_pass(s3, zone, started)
    assert [o.status for o in second] == ["new", "new"]
    assert [o.run_id for o in second] == [o.run_id for o in first]
    assert [o.run_id for o in second] == [run_id_for("a.jsonl", hashlib.sha256(A).hexdigest()),
                                          run_id_for("b.jsonl", hashlib.sha256(B).hexdigest())]
    assert len(started) == 4 and len(set(started)) == 2  # asked twice each, created once each
    assert get(s3, second[0].claim.input_uri) == A and get(s3, second[1].claim.input_uri) == B
    assert one_pass(s3, zone, started) == [] and len(started) == 4


def test_outage_between_the_claim_record_and_its_seen_marker_starts_nothing_again(store, s3, zone):
    put(s3, zone, "a.jsonl", A)
    [obj] = find_new(s3, zone)
    new = claim(s3, zone, obj)
    store.stop_on(s3, "PutObject", "/seen/")  # record's first write lands, its second does not
    with pytest.raises(EndpointConnectionError):
        record(s3, zone, new.claim)

    store.restart()
    s3 = store.client()
    started = [new.run_id]
    [again] = one_pass(s3, zone, started)
    assert again.status == "duplicate" and again.run_id == new.run_id
    assert started == [new.run_id]  # a duplicate starts nothing
    assert one_pass(s3, zone, started) == []  # the duplicate pass wrote the seen marker


@pytest.mark.parametrize(("operation", "key_part"), [
    ("ListObjectsV2", "/inbox/"),      # find_new, listing the inbox
    ("ListObjectsV2", "/seen/"),       # find_new, listing the seen markers
    ("GetObject", "/inbox/a.jsonl"),   # claim, hashing the drop
    ("HeadObject", "/claims/"),        # claim, looking for a claim record
    ("CopyObject", "/inputs/"),        # claim, snapshotting the input
], ids=["list-inbox", "list-seen", "hash", "claim-lookup", "snapshot"])
def test_outage_while_finding_or_claiming_raises_and_the_drop_is_claimed_once_later(
    store, s3, zone, operation, key_part
):
    put(s3, zone, "a.jsonl", A)
    store.stop_on(s3, operation, key_part)
    started: list[str] = []
    with pytest.raises(EndpointConnectionError):  # not "nothing new", not "changed"
        one_pass(s3, zone, started)
    assert started == []
    assert not store.up  # it was this request that met the outage

    store.restart()
    s3 = store.client()
    assert state_keys(s3, zone) == []  # nothing half-written
    [outcome] = one_pass(s3, zone, started)
    sha = hashlib.sha256(A).hexdigest()
    assert outcome.status == "new" and outcome.sha256 == sha
    assert started == [run_id_for("a.jsonl", sha)]
    assert get(s3, outcome.claim.input_uri) == A
    assert one_pass(s3, zone, started) == [] and len(started) == 1
