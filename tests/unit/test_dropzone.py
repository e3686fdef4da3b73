"""The drop zone's pure parts: names, run ids, settings, which listed objects are new."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from aibrix_operators.dropzone.core import (
    Claim,
    DropZone,
    DropZoneConfigError,
    InboxObject,
    batch_conf,
    is_candidate,
    new_objects,
    parse_listing,
    run_id_for,
    seen_ids,
)
from aibrix_operators.settings.dropzone import parse_settings

ZONE = DropZone.parse("s3://bkt/inbox", "s3://bkt/outbox/")
SHA_A, SHA_B = "a" * 64, "b" * 64


def test_prefixes_are_normalised_and_state_lives_under_the_outbox():
    assert (ZONE.inbox, ZONE.outbox) == ("s3://bkt/inbox/", "s3://bkt/outbox/")
    assert ZONE.state == "s3://bkt/outbox/_dropzone/"
    assert ZONE.output_uri("team/a.jsonl") == "s3://bkt/outbox/team/a.jsonl"
    assert ZONE.input_snapshot_uri(SHA_A) == f"s3://bkt/outbox/_dropzone/inputs/{SHA_A}.jsonl"


@pytest.mark.parametrize("inbox,outbox", [
    ("s3://bkt/in/", "s3://bkt/in/out/"),   # results would be picked up as drops
    ("s3://bkt/out/in/", "s3://bkt/out/"),
    ("s3://bkt/", "s3://bkt/out/"),
    ("s3://bkt/x/", "s3://bkt/x"),
    ("/local/inbox", "s3://bkt/out/"),
])
def test_overlapping_or_non_s3_prefixes_are_refused(inbox, outbox):
    with pytest.raises(DropZoneConfigError):
        DropZone.parse(inbox, outbox)


@pytest.mark.parametrize("name,ok", [
    ("a.jsonl", True), ("team/a.jsonl", True), ("no-extension", True),
    ("team/", False), (".a.jsonl.swp", False), ("_SUCCESS", False), ("team/_tmp/a.jsonl", False),
    ("_dropzone/claims/x.json", False), ("a//b.jsonl", False), ("", False),
])
def test_hidden_temporary_and_folder_names_are_not_drops(name, ok):
    assert is_candidate(name) is ok


def test_run_id_is_deterministic_per_name_and_content_and_valid_for_airflow():
    run = run_id_for("team/Q3 reviews.jsonl", SHA_A)
    assert run == run_id_for("team/Q3 reviews.jsonl", SHA_A)
    assert run.startswith("dropzone__team-Q3-reviews.jsonl__")
    assert re.fullmatch(r"^[A-Za-z0-9_.~:+-]+$", run)  # Airflow's allowed_run_id_pattern
    others = {run_id_for("team/Q3 reviews.jsonl", SHA_B), run_id_for("team/Q3_reviews.jsonl", SHA_A),
              run_id_for("team/Q3-reviews.jsonl", SHA_A)}
    assert run not in others and len(others) == 3  # slugs may collide; the key never does
    assert len(run_id_for("x" * 1000, SHA_A)) < 250
    assert run_id_for("日本語.jsonl", SHA_A).startswith("dropzone__jsonl__")


def test_listing_filters_names_strips_etag_quotes_and_ignores_other_prefixes():
    contents = [
        {"Key": "inbox/a.jsonl", "ETag": '"e1"', "Size": 10},
        {"Key": "inbox/_SUCCESS", "ETag": '"e2"', "Size": 0},
        {"Key": "inbox/sub/", "ETag": '"e3"', "Size": 0},
        {"Key": "inboxer/b.jsonl", "ETag": '"e4"', "Size": 1},
    ]
    assert parse_listing(ZONE, contents) == [InboxObject("a.jsonl", "e1", 10)]


def test_an_object_version_is_new_until_its_seen_marker_exists():
    a1, a2, b = InboxObject("a.jsonl", "e1", 10), InboxObject("a.jsonl", "e2", 10), InboxObject("b", "e1", 10)
    seen = seen_ids(ZONE, [{"Key": f"outbox/_dropzone/seen/{a1.version_id}"}])
    assert new_objects([a1, a2, b], seen) == [a2, b]
    # Same ETag and name but another size is another version (a truncated re-upload).
    assert InboxObject("a.jsonl", "e1", 11).version_id != a1.version_id


def _get(values):
    return lambda key: values.get(key)


def test_settings_parse_with_documented_defaults():
    s = parse_settings(_get({"inbox": "s3://bkt/inbox/", "outbox": "s3://bkt/outbox/",
                             "dag_conf": json.dumps({"endpoint": "http://vllm:8000"})}))
    assert s.zone == ZONE and s.aws_conn_id is None and s.dag_conf == {"endpoint": "http://vllm:8000"}
    assert (s.poll_interval_s, s.wait_timeout_s, s.max_files_per_run) == (30.0, 3600.0, 32)


BASE = {"inbox": "s3://bkt/inbox/", "outbox": "s3://bkt/outbox/"}


@pytest.mark.parametrize("values,match", [
    ({}, "not configured"),
    ({"inbox": "s3://bkt/inbox/"}, "not configured"),
    ({**BASE, "dag_conf": "{nope"}, "not JSON"),
    ({**BASE, "dag_conf": "[1]"}, "JSON object"),
    ({**BASE, "dag_conf": '{"output_uri": "s3://elsewhere/"}'}, "may not set output_uri"),
    ({**BASE, "poll_interval_s": "0"}, "positive"),
    ({**BASE, "max_files_per_run": "many"}, "could not convert"),
])
def test_bad_settings_say_what_to_fix(values, match):
    with pytest.raises(DropZoneConfigError, match=match):
        parse_settings(_get(values))


def test_batch_conf_derives_places_and_keeps_the_deployments_params():
    claim = Claim(name="a.jsonl", etag="e1", size=10, sha256=SHA_A, source_uri="s3://bkt/inbox/a.jsonl",
                  input_uri=ZONE.input_snapshot_uri(SHA_A), output_uri=ZONE.output_uri("a.jsonl"),
                  run_id=run_id_for("a.jsonl", SHA_A))
    conf = batch_conf(claim, {"endpoint": "http://vllm:8000", "concurrency": 8}, "batch_s3")
    assert conf == {
        "endpoint": "http://vllm:8000", "concurrency": 8,
        "input_uri": f"s3://bkt/outbox/_dropzone/inputs/{SHA_A}.jsonl",
        "output_uri": "s3://bkt/outbox/a.jsonl", "aws_conn_id": "batch_s3",
        "metadata": {"dropzone_source": "s3://bkt/inbox/a.jsonl", "dropzone_sha256": SHA_A},
    }


@pytest.mark.e2e
def test_the_dag_waits_claims_starts_batch_inference_and_records():
    import importlib.util
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    os.environ.setdefault("AIRFLOW_HOME", str(repo / ".work" / "airflow-unit"))
    spec = importlib.util.spec_from_file_location("s3_dropzone_dag", repo / "dags" / "s3_dropzone.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dag = module.dag
    assert dag.max_active_runs == 1 and type(dag.timetable).__name__ == "ContinuousTimetable"
    assert dag.start_date is not None  # else Airflow 3.3.2 never schedules a second continuous run
    tasks = dag.task_dict
    assert tasks["claim"].upstream_task_ids == {"wait"}
    assert tasks["start_batch"].upstream_task_ids == {"claim"}
    start = tasks["start_batch"].partial_kwargs
    assert start["trigger_dag_id"] == "batch_inference" and start["skip_when_already_exists"] is True
    assert tasks["record"].upstream_task_ids == {"start_batch"}
    assert tasks["record"].trigger_rule == "none_failed"  # skipped starts (run exists) still recorded


def test_sensor_unconfigured_waits_then_fails_with_the_keys_to_set(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

    from aibrix_operators.operators.dropzone import DropZoneSensor

    for key in ("INBOX", "OUTBOX"):
        monkeypatch.delenv(f"AIRFLOW__AIBRIX_DROPZONE__{key}", raising=False)
    sensor = DropZoneSensor(task_id="wait")
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.method_name == "not_configured"
    wait = deferred.value.trigger.moment - datetime.now(UTC)
    assert timedelta(minutes=59) < wait <= DropZoneSensor.NOT_CONFIGURED_WAIT  # not a tight loop
    with pytest.raises(AirflowFailException, match=r"set inbox and outbox in the \[aibrix_dropzone\]"):
        getattr(sensor, deferred.value.method_name)({}, event=None, **deferred.value.kwargs)


def test_sensor_defers_to_the_inbox_trigger_with_the_deployments_settings(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskDeferred

    from aibrix_operators.operators.dropzone import DropZoneSensor

    monkeypatch.setenv("AIRFLOW__AIBRIX_DROPZONE__INBOX", "s3://bkt/inbox")
    monkeypatch.setenv("AIRFLOW__AIBRIX_DROPZONE__OUTBOX", "s3://bkt/outbox")
    monkeypatch.setenv("AIRFLOW__AIBRIX_DROPZONE__POLL_INTERVAL_S", "5")
    sensor = DropZoneSensor(task_id="wait")
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    _, kwargs = deferred.value.trigger.serialize()
    assert {k: kwargs[k] for k in ("inbox", "outbox", "aws_conn_id", "poll_interval_s", "max_files")} == {
        "inbox": "s3://bkt/inbox/", "outbox": "s3://bkt/outbox/", "aws_conn_id": None,
        "poll_interval_s": 5.0, "max_files": 32}
    found = [{"name": "a.jsonl", "etag": "e1", "size": 10}]
    assert sensor.execute_complete({}, {"status": "found", "objects": found}) == found
    with pytest.raises(AirflowSkipException):
        sensor.execute_complete({}, {"status": "timeout", "error": None})
    with pytest.raises(AirflowFailException, match="could not be listed: ClientError: denied"):
        sensor.execute_complete({}, {"status": "timeout", "error": "ClientError: denied"})
