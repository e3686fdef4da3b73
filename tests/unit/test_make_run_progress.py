"""`make run` says what it waits for (first-hour review: it was silent for ~2.5 minutes while the
DAG waited for vLLM). A real subprocess stands in for `airflow dags test`; the log lines are the
shapes Airflow 3.3's `dags test` writes (copied from a `make run` log)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_example", REPO / "scripts" / "run_example.py")
assert _spec is not None and _spec.loader is not None
run_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_example)


@pytest.mark.service
def test_a_line_every_interval_while_the_dag_runs(capsys) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.2)"])
    rc = run_example.wait_with_progress(proc, lambda: "vLLM is still starting", 0.25, time.monotonic())
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert 3 <= len(lines) <= 6, lines
    assert all(line.endswith("s] vLLM is still starting") for line in lines)


def test_the_task_is_the_last_one_the_log_names(tmp_path: Path) -> None:
    log = tmp_path / "dag.log"
    assert run_example.last_task(log) is None  # not written yet
    log.write_text(
        "[2026-12-05T13:20:01] {taskinstance.py} INFO - <TaskInstance: batch_inference.validate manual__1 "
        "[running]>\n"
        "[2026-12-05T13:20:04] INFO - Task finished dag_id=batch_inference task_id='split' state=success\n"
        "[2026-12-05T13:20:05] INFO - Running task dag_id=batch_inference task_id=dispatch map_index=0\n"
    )
    assert run_example.last_task(log) == "dispatch"
