"""S3 keys stay within 1,024 bytes (issue 24): the bound a batch's keys reach under its output
prefix (``batch/records.py`` LONGEST_WORK_KEY_SUFFIX) is measured on a real batch run here, and
a drop-zone name or an output_uri whose batch would pass it is refused before any work."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from aibrix_operators.batch.job import (
    finalize_batch,
    prefix_order_uri,
    request_cancel,
    split_batch,
    validate_batch,
)
from aibrix_operators.batch.records import LONGEST_WORK_KEY_SUFFIX, S3_MAX_KEY_BYTES, work_prefix
from aibrix_operators.driver.batch_shard import run_shard_of_batch
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.dropzone import core
from aibrix_operators.dropzone.core import DropZone, InboxObject, claim, key_length_problem, parse_listing
from aibrix_operators.storage import LocalStorage
from tests.fake_openai import FakeOpenAI

ZONE = DropZone.parse("s3://bkt/in/", "s3://bkt/results/")


class RecordingStorage(LocalStorage):
    """Local storage that remembers every object written."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[str] = []

    def write_bytes(self, uri: str, data: bytes) -> None:
        self.written.append(uri)
        super().write_bytes(uri, data)

    def open_write(self, uri: str) -> Any:
        self.written.append(uri)
        return super().open_write(uri)


async def test_the_bound_is_the_longest_key_a_real_batch_writes(tmp_path, lines):
    server = await FakeOpenAI().astart()
    try:
        storage = RecordingStorage()
        src = tmp_path / "in.jsonl"
        src.write_bytes(lines(12))
        out = str(tmp_path / "out")
        run_id = "manual__2026-12-05T10:00:00+00:00"
        work = work_prefix(out, run_id)
        _, batch = validate_batch(
            storage,
            str(src),
            out,
            min_window_s=1,
            prefix_grouping="auto",
            prefix_order_uri=prefix_order_uri(work),
        )
        assert batch is not None
        shards = split_batch(
            storage, batch, work, requests_per_shard=5, bytes_per_shard=1 << 20, max_shards=8
        )
        config = DriverConfig(
            endpoint=f"{server.url}/v1",
            concurrency=2,
            api_key_env=None,
            flush_interval_s=0.01,
            flush_every=2,
            progress_interval_s=60,
        )
        for shard in shards:
            await run_shard_of_batch(storage, shard, work, config)
        finalize_batch(storage, batch, shards, work)
        request_cancel(storage, work)
    finally:
        await server.aclose()
    under_work = [uri for uri in storage.written if uri.startswith(work + "/")]
    beside = [uri for uri in storage.written if not uri.startswith(work + "/")]
    assert {uri.rsplit("/", 1)[-1] for uri in beside} == {"output.jsonl", "errors.jsonl", "batch.json"}
    assert any("/results/shard-" in uri and "/seg-" in uri for uri in under_work)
    assert any("/shards/shard-" in uri for uri in under_work)
    assert any(uri.endswith("/CANCEL") for uri in under_work)
    # The fixed-width parts (shard index, binding, attempt id, sequence) make every segment key
    # exactly as long as the bound says; nothing the batch writes is longer.
    assert max(len(uri) - len(work) for uri in storage.written) == LONGEST_WORK_KEY_SUFFIX


def test_a_drop_whose_batch_would_pass_the_s3_key_limit_is_refused_before_anything_is_read(caplog):
    # The inbox key of a 996-character name fits S3 (1,003 bytes), but its batch's segments would
    # not: results/<name>/_work/dropzone__<slug>__<key>/results/... is 1,215 bytes.
    name = "n" * 992 + ".txt"
    problem = key_length_problem(ZONE, name)
    assert problem is not None
    assert "996 bytes" in problem and "keys of up to 1215 bytes" in problem
    assert "over S3's limit of 1024 bytes by 191" in problem
    assert "a name that much shorter" in problem

    class Untouchable:
        def __getattr__(self, attr: str) -> Any:
            raise AssertionError(f"the S3 client was used ({attr}) for a refused drop")

    obj = InboxObject(name, "etag", 10)
    with caplog.at_level(logging.ERROR, logger="aibrix_operators.dropzone.core"):
        outcome = claim(Untouchable(), ZONE, obj)
    assert (outcome.status, outcome.claim, outcome.reason) == ("refused", None, problem)
    assert "not starting a batch" in caplog.text and "over S3's limit" in caplog.text
    # Listing leaves it out (one warning per process), so it never takes a claim's place.
    core._refused.discard(name)
    listed = [
        {"Key": f"in/{name}", "ETag": '"e"', "Size": 10},
        {"Key": "in/ok.jsonl", "ETag": '"e"', "Size": 1},
    ]
    with caplog.at_level(logging.WARNING, logger="aibrix_operators.dropzone.core"):
        assert [o.name for o in parse_listing(ZONE, listed)] == ["ok.jsonl"]
        assert [o.name for o in parse_listing(ZONE, listed)] == ["ok.jsonl"]
    assert sum("too long" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1


def test_the_longest_accepted_name_writes_keys_of_exactly_1024_bytes():
    def longest(name: str) -> int:
        work = work_prefix(ZONE.output_uri(name), core.run_id_for(name, "0" * 64))
        return len(work[len("s3://bkt/") :].encode()) + LONGEST_WORK_KEY_SUFFIX

    fits = max(n for n in range(1, 1024) if key_length_problem(ZONE, "a" * n) is None)
    assert longest("a" * fits) <= S3_MAX_KEY_BYTES < longest("a" * (fits + 1))
    # Bytes, not characters: a name of multi-byte characters is refused at fewer of them.
    assert key_length_problem(ZONE, "a" * (fits - 1) + "é") is not None


def test_the_validate_step_refuses_an_s3_output_whose_keys_would_be_too_long(storage, write_file, lines):
    class NoWrites(LocalStorage):
        def write_bytes(self, uri: str, data: bytes) -> None:
            self.record = (uri, json.loads(data))

    out_storage = NoWrites()
    output = "s3://bkt/" + "o" * 900
    work = work_prefix(output, "scheduled__2026-12-05T10:00:00+00:00")
    report, batch = validate_batch(
        storage,
        write_file(lines(2)),
        output,
        min_window_s=1,
        output_storage=out_storage,
        prefix_order_uri=prefix_order_uri(work),
    )
    assert batch is None
    [error] = report.errors
    assert (error.code, error.param) == ("invalid_output_uri", "output_uri")
    assert "over S3's limit of 1024 bytes" in error.message and "choose an output_uri" in error.message
    assert out_storage.record[1]["errors"]["data"][0]["code"] == "invalid_output_uri"
    # A shorter output validates.
    ok = "s3://bkt/" + "o" * 800
    assert (
        validate_batch(
            storage,
            write_file(lines(2)),
            ok,
            min_window_s=1,
            output_storage=out_storage,
            prefix_order_uri=prefix_order_uri(work_prefix(ok, "r")),
        )[1]
        is not None
    )


@pytest.mark.parametrize("name", ["a.jsonl", "team/q3/reviews.jsonl", "x" * 700])
def test_ordinary_names_are_not_refused(name):
    assert key_length_problem(ZONE, name) is None
