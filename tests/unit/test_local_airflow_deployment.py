"""local_airflow.AirflowDeployment as a context manager: the fixtures' one way to stop a stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from aibrix_operators import local_airflow
from aibrix_operators.local_airflow import AirflowDeployment


def test_with_stops_every_component_last_started_first_however_the_block_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stopped: list[str] = []
    monkeypatch.setattr(local_airflow, "stop_process_group", stopped.append)
    procs = ["api-server", "scheduler", "dag-processor", "triggerer"]  # stand-ins for the Popens
    with pytest.raises(RuntimeError, match="the test failed"):
        with AirflowDeployment({}, "http://127.0.0.1:1", procs, tmp_path) as deployment:  # type: ignore[arg-type]
            assert deployment.procs is procs
            raise RuntimeError("the test failed")
    assert stopped == ["triggerer", "dag-processor", "scheduler", "api-server"]
    with AirflowDeployment({}, "http://127.0.0.1:1", procs[:1], tmp_path):  # type: ignore[arg-type]
        pass
    assert stopped[-1] == "api-server" and len(stopped) == 5
