"""The deployment's shortest completion_window ([aibrix_batch] min_completion_window, default 1h)
in the DAG's validate step and the drop zone (the Batch API's 400 is in
test_batch_api_openai_rules.py), and the window parser taking ASCII digits only (issue 24)."""

from __future__ import annotations

import json

import pytest

from aibrix_operators.batch.job import validate_batch
from aibrix_operators.batch.records import parse_completion_window
from aibrix_operators.dropzone.core import DropZoneConfigError
from aibrix_operators.settings.completion_window import (
    MinWindowSettingError,
    load_min_completion_window_s,
    min_completion_window_s,
)
from aibrix_operators.settings.dropzone import parse_settings

ENV = "AIRFLOW__AIBRIX_BATCH__MIN_COMPLETION_WINDOW"


def test_the_validate_step_fails_a_batch_under_the_minimum_saying_the_minimum(storage, write_file, lines,
                                                                              tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    uri = write_file(lines(3))
    out = tmp_path / "out"
    report, batch = validate_batch(storage, uri, str(out), completion_window="1s", batch_id="batch_x")
    assert batch is None
    [error] = report.errors
    assert (error.code, error.param) == ("invalid_completion_window", "completion_window")
    assert "minimum of 1h ([aibrix_batch] min_completion_window)" in error.message
    assert "at least 1h" in error.message
    written = json.loads((out / "batch.json").read_text())  # the failed batch says it too
    assert written["status"] == "failed" and written["errors"]["data"][0]["message"] == error.message
    # At the minimum it validates; the deployment may lower it (the operator passes its setting,
    # read as Airflow reads config: here by env).
    assert validate_batch(storage, uri, str(tmp_path / "ok"), completion_window="60m")[1] is not None
    monkeypatch.setenv(ENV, "1s")
    assert load_min_completion_window_s() == 1
    assert validate_batch(storage, uri, str(tmp_path / "short"), completion_window="1s",
                          min_window_s=load_min_completion_window_s())[1] is not None
    # A caller may say the minimum itself.
    report, batch = validate_batch(storage, uri, str(tmp_path / "own"), completion_window="2h",
                                   min_window_s=3 * 3600)
    assert batch is None and "minimum of 3h" in report.errors[0].message


def test_the_setting_reads_durations_and_names_itself_when_wrong(monkeypatch):
    assert min_completion_window_s({}.get) == 3600  # default 1h
    assert min_completion_window_s({"min_completion_window": " 90m "}.get) == 5400
    assert min_completion_window_s({"min_completion_window": ""}.get) == 3600
    with pytest.raises(MinWindowSettingError, match=r"\[aibrix_batch\] min_completion_window = '1d'"):
        min_completion_window_s({"min_completion_window": "1d"}.get)
    monkeypatch.setenv(ENV, "30s")
    assert load_min_completion_window_s() == 30


def test_the_drop_zone_refuses_a_dag_conf_window_under_the_minimum():
    base = {"inbox": "s3://bkt/inbox/", "outbox": "s3://bkt/outbox/"}
    short = {**base, "dag_conf": json.dumps({"completion_window": "10m"})}
    with pytest.raises(DropZoneConfigError) as exc:
        parse_settings(short.get)
    message = str(exc.value)
    assert "[aibrix_dropzone] dag_conf" in message and "minimum of 1h" in message
    assert "[aibrix_batch] min_completion_window" in message and "at least 1h" in message
    assert parse_settings(short.get, min_window_s=600).dag_conf == {"completion_window": "10m"}
    assert parse_settings({**base, "dag_conf": '{"completion_window": "2h"}'}.get).dag_conf
    with pytest.raises(DropZoneConfigError, match="not a duration"):
        parse_settings({**base, "dag_conf": '{"completion_window": "٢h"}'}.get)


@pytest.mark.parametrize("window", ["١h", "٢٤h", "２4h", "2\u0664h", "²h", "1" * 10 + "h", "+1h", " 1h",
                                    "1h\n"])
def test_the_window_parser_takes_ascii_digits_only(window):
    with pytest.raises(ValueError, match="completion_window"):
        parse_completion_window(window)
    assert parse_completion_window("999999999s") == 999_999_999  # nine digits: still a duration
