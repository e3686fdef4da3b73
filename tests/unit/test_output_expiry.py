"""Outputs that expire (batch/output_expiry.py): OpenAI's shape checked, the sweep deletes what is due
on real local storage, never what is not, never outside the allow-list; the files API hides an
expired file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from aibrix_operators.batch.output_expiry import (
    ExpiryRecord,
    expiring_uris,
    parse_expires_after,
    sweep,
    write_record,
)
from aibrix_operators.batch_api.batches import check_output_expires_after
from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.files import FileStore, StoredFile
from aibrix_operators.storage import LocalStorage


@pytest.mark.parametrize(("value", "says"), [
    ({"anchor": "created_at"}, "must be an object"),
    ({"anchor": "completed_at", "seconds": 3600}, "anchor must be 'created_at'"),
    ({"anchor": "created_at", "seconds": 60}, "from 3600 (1 hour) to 2592000 (30 days); got 60"),
    ({"anchor": "created_at", "seconds": 2592001}, "got 2592001"),
    ({"anchor": "created_at", "seconds": "3600"}, "got '3600'"),
    (3600, "must be an object"),
])
def test_only_openais_shape_and_bounds_are_accepted(value: object, says: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_expires_after(value)
    assert says in str(exc.value)
    assert parse_expires_after({"anchor": "created_at", "seconds": 7200}) == 7200
    assert parse_expires_after(None) is None


def test_the_api_refuses_a_promise_this_deployment_cannot_keep() -> None:
    good = {"anchor": "created_at", "seconds": 86400}
    assert check_output_expires_after(good, "s3://b/expiring") == good
    assert check_output_expires_after(None, None) is None
    with pytest.raises(ApiError) as exc:
        check_output_expires_after(good, None)  # no expiry index: nothing would delete them
    assert (exc.value.status, exc.value.code, exc.value.param) == (
        400, "invalid_output_expires_after", "output_expires_after")
    assert "state_root" in exc.value.message
    with pytest.raises(ApiError):
        check_output_expires_after({"anchor": "created_at", "seconds": 5}, "s3://b/expiring")


def _batch_outputs(root: Path, name: str) -> str:
    out = root / name
    out.mkdir(parents=True)
    for f in ("output.jsonl", "errors.jsonl", "batch.json"):
        (out / f).write_text(f"{name} {f}\n")
    return str(out)


def test_the_sweep_deletes_what_is_due_and_nothing_else(tmp_path: Path) -> None:
    storage = LocalStorage()
    index = str(tmp_path / "expiring")
    now = time.time()
    due = _batch_outputs(tmp_path, "due")
    later = _batch_outputs(tmp_path, "later")
    lying = _batch_outputs(tmp_path, "lying")  # named as due, its content says later: kept
    outside = _batch_outputs(tmp_path / "elsewhere", "outside")
    write_record(storage, index, ExpiryRecord("batch_due", int(now) - 5, expiring_uris(due)))
    write_record(storage, index, ExpiryRecord("batch_later", int(now) + 3600, expiring_uris(later)))
    lying_record = ExpiryRecord("batch_lying", int(now) + 3600, expiring_uris(lying))
    storage.write_bytes(f"{index}/{int(now) - 5:010d}-batch_lying.json", lying_record.to_bytes())
    write_record(storage, index, ExpiryRecord("batch_outside", int(now) - 5, expiring_uris(outside)))
    write_record(storage, index, ExpiryRecord("batch_odd", int(now) - 5, (f"{due}/batch.json",)))

    def allowed(uri: str, _conn: str | None) -> str | None:
        return None if "/elsewhere/" not in uri else f"{uri} is not under the allowed storage"

    result = sweep(storage, index, now, lambda _u, _c: storage, allowed)

    assert sorted(result.deleted) == sorted(expiring_uris(due))
    assert not Path(due, "output.jsonl").exists() and not Path(due, "errors.jsonl").exists()
    assert Path(due, "batch.json").exists()  # the batch's own record stays
    for kept in (later, lying, outside):
        assert Path(kept, "output.jsonl").exists() and Path(kept, "errors.jsonl").exists(), kept
    assert result.records_done == 1 and result.not_due == 2
    assert len(result.refused) == 2
    assert any("not under the allowed storage" in r for r in result.refused)
    assert any("is not a batch's output or error file" in r for r in result.refused)
    left = sorted(p.name.split("-", 1)[1] for p in Path(index).iterdir())
    assert left == ["batch_later.json", "batch_lying.json", "batch_odd.json", "batch_outside.json"]
    # A second sweep at the same instant finds nothing more to do; one an hour later takes the rest.
    assert sweep(storage, index, now, lambda _u, _c: storage, allowed).deleted == []
    later_sweep = sweep(storage, index, now + 3601, lambda _u, _c: storage, allowed)
    assert sorted(later_sweep.deleted) == sorted(expiring_uris(later) + expiring_uris(lying))


def test_the_files_api_hides_an_expired_output(tmp_path: Path) -> None:
    storage = LocalStorage()
    files = FileStore(storage, str(tmp_path / "api"))
    content = tmp_path / "api" / "tenants" / "team-a" / "out.jsonl"
    content.parent.mkdir(parents=True)
    content.write_text("{}\n")
    for file_id, expires_at in (("file-018f00000000aaaaaaaaaaaaaaaaaaaa-output", int(time.time()) + 60),
                                ("file-018f00000000bbbbbbbbbbbbbbbbbbbb-output", int(time.time()) - 1)):
        files.save_meta("team-a", StoredFile(id=file_id, bytes=3, created_at=0, filename="o.jsonl",
                                             purpose="batch_output", content_uri=str(content),
                                             expires_at=expires_at))
    live = files.get("team-a", "file-018f00000000aaaaaaaaaaaaaaaaaaaa-output")
    assert live.as_openai()["expires_at"] == live.expires_at
    with pytest.raises(ApiError) as exc:
        files.get("team-a", "file-018f00000000bbbbbbbbbbbbbbbbbbbb-output")
    assert exc.value.status == 404
    page, _ = files.list("team-a", None, 100, "desc", None)
    assert [f.id for f in page] == ["file-018f00000000aaaaaaaaaaaaaaaaaaaa-output"]
    assert json.loads(json.dumps(live.as_openai()))["expires_at"] > time.time()
