"""The batch-driver image, built from inference_images/batch_driver/Dockerfile, does its job:
a shard sent from the container to a local endpoint, every id answered once, results in a
mounted directory or in S3 (real SeaweedFS)."""

from __future__ import annotations

import json
import os
import re

import pytest

from aibrix_operators.storage import LocalStorage, S3Storage
from tests.driver.test_driver_faults import results_by_id, write_shard
from tests.images.containers import inspect, last_error_line, run

pytestmark = pytest.mark.e2e

FAST = ["--backoff-base", "0.01", "--backoff-max", "0.1", "--flush-interval", "0.05",
        "--progress-interval", "0.5"]  # fmt: skip


def test_the_entrypoint_starts_and_runs_as_non_root(driver_image):
    proc = run(driver_image, "--help", timeout=60)
    # A requirement missing from the image ends here with the image's own error line.
    assert proc.returncode == 0, f"driver image entrypoint crashed: {last_error_line(proc)}"
    assert "--shard-uri" in proc.stdout and "exit codes" in proc.stdout
    assert inspect(driver_image, "{{.Config.User}}") == "65532:65532"
    where = run(driver_image, "-c", "import aibrix_operators, kvcache; print(aibrix_operators.__file__)",
                flags=["--entrypoint", "python"], timeout=60)  # fmt: skip
    assert where.returncode == 0, last_error_line(where)
    assert re.search(r"/(site|dist)-packages/aibrix_operators/", where.stdout), where.stdout  # the wheel


def test_a_shard_on_a_mounted_volume(driver_image, fault_server, make_request, tmp_path):
    data = tmp_path / "data"
    records = [make_request(f"vol-{i}") for i in range(12)] + [make_request("bad", "400")]
    write_shard(data, records)
    os.chmod(data, 0o777)  # the image runs as uid 65532
    proc = run(
        driver_image,
        "--shard-uri", "/data/shard-00000.jsonl", "--results-prefix", "/data/results",
        "--endpoint", fault_server.url, "--model", "m", "--total", str(len(records)), *FAST,
        flags=["-v", f"{data}:/data:Z"],
    )  # fmt: skip
    # exit 1: finished, with one error line of the request's own
    assert proc.returncode == 1, f"exit {proc.returncode}: {last_error_line(proc)}"
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (outcome["completed"], outcome["failed"]) == (12, 1)
    seen = results_by_id(LocalStorage(), str(data / "results"), str(data / "shard-00000.jsonl"))
    assert sorted(seen) == sorted(r["custom_id"] for r in records)
    assert seen["bad"]["error"] is not None and seen["vol-0"]["response"]["status_code"] == 200
    assert fault_server.counts() == {r["custom_id"]: 1 for r in records}


def test_a_shard_in_s3(driver_image, fault_server, make_request, s3_server, tmp_path):
    s3 = s3_server.client()
    s3.create_bucket(Bucket="driver-image")
    records = [make_request(f"s3-{i}") for i in range(20)]
    body = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    s3.put_object(Bucket="driver-image", Key="run/shards/shard-00000.jsonl", Body=body)
    # Credentials pass by name (-e NAME takes podman's own value), never on a command line.
    env = [item for key in s3_server.env() for item in ("-e", key)]
    proc = run(
        driver_image,
        "--shard-uri", "s3://driver-image/run/shards/shard-00000.jsonl",
        "--results-prefix", "s3://driver-image/run/results/shard-00000",
        "--endpoint", fault_server.url, "--total", "20", *FAST,
        flags=env, env={**os.environ, **s3_server.env()},
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}: {last_error_line(proc)}"
    storage = S3Storage(client=s3)
    seen = results_by_id(storage, "s3://driver-image/run/results/shard-00000",
                         "s3://driver-image/run/shards/shard-00000.jsonl")  # fmt: skip
    assert sorted(seen) == sorted(r["custom_id"] for r in records)
    assert all(r["response"]["status_code"] == 200 for r in seen.values())
    assert fault_server.counts() == {r["custom_id"]: 1 for r in records}
