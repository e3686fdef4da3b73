"""The pipeline's modules, imported once in the components that fork a DAG parse per task
(settings/warm_imports.py, called from the deployment's airflow_local_settings.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aibrix_operators.localenv import airflow_env
from aibrix_operators.settings.warm_imports import forks_dag_parses

REPO = Path(__file__).resolve().parents[2]
# What parsing a pipeline DAG file cost in every fork before the warm-up (1.1-1.4 CPU-s a parse).
HEAVY = ("boto3", "botocore", "aiohttp", "numpy", "airflow.providers.amazon.aws.hooks.s3",
         "aibrix_operators.operators.pipeline")


def test_only_the_components_that_fork_parses_warm_up() -> None:
    for argv in (["airflow", "scheduler"], ["/usr/bin/airflow", "dag-processor", "--subdir", "x"],
                 ["airflow", "celery", "worker", "-q", "default"], ["airflow", "edge", "worker"],
                 ["airflow", "-v", "scheduler"]):
        assert forks_dag_parses(argv), argv
    for argv in (["airflow", "api-server"], ["airflow", "triggerer"], ["airflow", "db", "migrate"],
                 ["airflow", "celery", "flower"], ["airflow", "dags", "list"], ["airflow"], []):
        assert not forks_dag_parses(argv), argv


# A fresh process as Airflow's components start (the local stack's plugins folder holds
# airflow_local_settings.py), then a fork per DAG file that parses it as a task's fork does:
# which of HEAVY each fork had to import itself.
PROBE = """
import json, os, runpy, sys
sys.argv = ["airflow"] + sys.argv[1:]
import airflow.settings
heavy, parsed = {heavy!r}, {{}}
for path in {dags!r}:
    r, w = os.pipe()
    if os.fork() == 0:
        before = set(sys.modules)
        runpy.run_path(path)
        os.write(w, json.dumps(sorted(m for m in set(sys.modules) - before if m in heavy)).encode())
        os._exit(0)
    os.close(w)
    parsed[os.path.basename(path)] = json.loads(os.read(r, 65536))
    os.wait()
print(json.dumps({{"parent": [m for m in heavy if m in sys.modules], "forks": parsed}}))
"""


@pytest.mark.service
@pytest.mark.parametrize("component", ["scheduler", "api-server"])
def test_a_forked_parse_of_every_pipeline_dag_imports_nothing_heavy_after_the_warm_up(
        tmp_path, component) -> None:
    dags = sorted(str(p) for p in (REPO / "dags").glob("*.py"))
    probe = PROBE.format(heavy=HEAVY, dags=dags)
    env = {**airflow_env(tmp_path / "home"), "PATH": os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-c", probe, *component.split()], capture_output=True, text=True,
                         timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen["forks"]) == len(dags) >= 4, seen
    if component == "scheduler":
        assert seen["parent"] == list(HEAVY), seen
        assert all(imported == [] for imported in seen["forks"].values()), seen["forks"]
    else:  # no warm-up where nothing forks a parse: the api-server starts as before
        assert seen["parent"] == [], seen
        # and the DAG files do need what the warm-up imports (else the list has gone stale)
        assert set(seen["forks"]["batch_inference.py"]) == set(HEAVY), seen["forks"]
