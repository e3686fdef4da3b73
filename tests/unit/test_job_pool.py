"""Job-pool settings: the file's shape, the deployment's limits by name, the max_workers rule,
and where each value lands (DAG params, the Batch API's conf, the driver pod, the client)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowRescheduleException
from hypothesis import given, settings
from hypothesis import strategies as st

from aibrix_operators.batch.job_pool import (
    JobPool,
    JobPoolError,
    JobPoolLimits,
    PoolLimitExceeded,
    load_pool_file,
    memory_bytes,
)
from aibrix_operators.batch_api.batches import check_pool, dag_conf
from aibrix_operators.batch_api.errors import ApiError
from aibrix_operators.batch_api.settings import ApiSettings, ModelRoute, load_settings
from aibrix_operators.client.batch_client import pool_request
from aibrix_operators.client.errors import ExitCode, PoolConfigError
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver_pods.spec import DriverPodRequest, DriverPodSettings, build_driver_pod
from aibrix_operators.operators.pipeline import BATCH_PARAMS
from aibrix_operators.operators.step_errors import step_error_code
from aibrix_operators.scheduling.shard_turns import (
    CHECK_AT_MOST_EVERY_S,
    ENDED_STATES,
    MIN_CHECK_S,
    next_check_s,
    shards_to_wait_for,
    wait_for_turn,
)
from aibrix_operators.settings.job_pool import job_pool_limits

POOL_YAML = """\
# AIBrix's keys, and this pipeline's
pool:
  max_workers: 2
  memory_per_job: 2Gi
  gpu_policy: spread
  requests_per_shard: 500
  concurrency: 32
"""


def test_a_pool_file_becomes_the_dag_params_of_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(POOL_YAML)
    pool = load_pool_file(path)
    assert pool.as_params() == {"max_workers": 2, "memory_per_job": "2Gi", "gpu_policy": "spread",
                                "requests_per_shard": 500, "concurrency": 32}
    assert set(pool.as_params()) <= set(BATCH_PARAMS)  # every key is a DAG param of that name
    path.write_text("pool:\n  max_workers: 3\n")
    assert load_pool_file(path).as_params() == {"max_workers": 3}  # unset keys keep the defaults


@pytest.mark.parametrize(("text", "says"), [
    ("pool:\n  max_worker: 2\n", "unknown key(s) max_worker; known: max_workers"),
    ("pool:\n  max_workers: 0\n", "max_workers must be a whole number of at least 1, not 0"),
    ("pool:\n  max_workers: two\n", "max_workers must be a whole number"),
    ("pool:\n  max_workers: true\n", "max_workers must be a whole number"),
    ("pool:\n  concurrency: 2.5\n", "concurrency must be a whole number"),
    ("pool:\n  memory_per_job: 2GB\n", "memory_per_job '2GB' is not a Kubernetes memory quantity"),
    ("pool:\n  memory_per_job: 16Mi\n", "memory_per_job 16Mi is below 64Mi"),
    ("pool:\n  memory_per_job: 2048\n", "memory_per_job must be a quantity such as 2Gi, not 2048"),
    ("pool:\n  gpu_policy: scatter\n", "gpu_policy must be one of pack, spread, not 'scatter'"),
    ("max_workers: 2\n", "must hold one mapping, pool: and/or stop_rules: (found ['max_workers'])"),
    ("pool: [1, 2]\n", "pool must be a mapping of max_workers"),
    ("pool:\n  max_workers: [\n", "is not YAML at line"),
    ("", "must hold one mapping, pool: and/or stop_rules: (found NoneType)"),
])
def test_a_bad_pool_file_names_the_key_and_the_fix(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    with pytest.raises(JobPoolError) as exc:
        load_pool_file(path)
    assert says in str(exc.value)
    assert str(path) in str(exc.value)  # where: the file
    with pytest.raises(JobPoolError, match="does not exist"):
        load_pool_file(tmp_path / "missing.yaml")


def test_memory_quantities_read_as_kubernetes_reads_them() -> None:
    assert memory_bytes("2Gi") == 2 * 2**30
    assert memory_bytes("1500M") == 1_500_000_000
    assert memory_bytes("0.5Gi") == 2**29
    assert memory_bytes("134217728") == 2**27
    for bad in ("2 Gi", "2gi", "-1Gi", "1e3", "Gi", ""):
        with pytest.raises(JobPoolError):
            memory_bytes(bad)


def test_memory_quantities_are_read_exactly_and_bounded_in_length() -> None:
    # Exact integers, never a float: 1 byte over 8 EiB is not rounded away; a fraction of a
    # byte rounds up, as Kubernetes rounds it.
    assert memory_bytes("9223372036854775808") == 2**63
    assert memory_bytes("0.1Ki") == 103 and memory_bytes("1.000000001G") == 1_000_000_001
    assert memory_bytes("8191.99999999Pi") == -(-819199999999 * 2**50 // 10**8)
    for bad in ("9" * 400, "9" * 25, "1" + "0" * 30 + "Ki"):
        with pytest.raises(JobPoolError, match="memory_per_job may be at most 24 characters"):
            memory_bytes(bad)  # was OverflowError: int(float("9" * 400))
    for bad in ("٢Gi", "２Gi", "2\u0663Mi".encode().decode("unicode_escape"), "²Gi", "1.Gi", ".5Gi"):
        with pytest.raises(JobPoolError, match="not a Kubernetes memory quantity"):
            memory_bytes(bad)
    # The same parser reads pool files, DAG params and the deployment's limit, by their names.
    with pytest.raises(JobPoolError, match="pool: memory_per_job may be at most 24"):
        JobPool.from_mapping({"memory_per_job": "9" * 400})
    with pytest.raises(JobPoolError, match=r"\[aibrix_batch\] pool_max_memory_per_job may be at most 24"):
        job_pool_limits({"pool_max_memory_per_job": "9" * 400}.get)


def test_a_pool_file_with_a_400_digit_memory_names_the_file_and_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("pool:\n  memory_per_job: '" + "9" * 400 + "'\n")
    with pytest.raises(JobPoolError, match="memory_per_job may be at most 24 characters") as exc:
        load_pool_file(path)
    assert str(path) in str(exc.value)


def test_each_value_over_the_deployments_limit_is_refused_by_the_limits_name() -> None:
    limits = JobPoolLimits(max_workers=4, max_concurrency=128, min_requests_per_shard=100,
                           max_memory_per_job="4Gi", gpu_policy="spread")
    JobPool(max_workers=4, concurrency=128, requests_per_shard=100, memory_per_job="4096Mi",
            gpu_policy="spread").check(limits)  # at the limits: accepted
    cases = [
        (JobPool(max_workers=5), "pool_max_workers", "max_workers 5 is over 4"),
        (JobPool(concurrency=129), "pool_max_concurrency", "concurrency 129 is over 128"),
        (JobPool(requests_per_shard=99), "pool_min_requests_per_shard", "requests_per_shard 99 is under 100"),
        (JobPool(memory_per_job="4097Mi"), "pool_max_memory_per_job", "memory_per_job 4097Mi is over 4Gi"),
        (JobPool(gpu_policy="pack"), "gpu_policy", "the serving group is placed 'spread' by the deployment"),
    ]
    for pool, rule, says in cases:
        with pytest.raises(PoolLimitExceeded) as exc:
            pool.check(limits)
        assert exc.value.rule == rule and says in str(exc.value)
        assert f"refused by the deployment's limit {rule}" in str(exc.value)
        assert step_error_code(exc.value, "validate") == "refused_by_policy"  # in batch.json


def test_the_limits_come_from_the_deployments_config_keys() -> None:
    config = {"pool_max_workers": "3", "pool_max_memory_per_job": "1Gi", "gpu_policy": "pack"}
    limits = job_pool_limits(config.get)
    assert (limits.max_workers, limits.max_memory_per_job, limits.gpu_policy) == (3, "1Gi", "pack")
    assert limits.max_concurrency == JobPoolLimits().max_concurrency  # unset: the default
    with pytest.raises(JobPoolError, match=r"\[aibrix_batch\] pool_max_workers = 'many'"):
        job_pool_limits({"pool_max_workers": "many"}.get)
    with pytest.raises(JobPoolError, match="gpu_policy must be one of pack, spread"):
        job_pool_limits({"gpu_policy": "fill"}.get)


def test_the_batch_api_puts_the_pool_into_the_runs_conf_or_answers_400() -> None:
    settings_ = load_settings({"api_dag_conf": '{"concurrency": 16}', "pool_max_workers": "4"}.get,
                              Path("/r"))
    assert settings_.pool_limits.max_workers == 4
    params = check_pool({"max_workers": 2, "concurrency": 8}, settings_.pool_limits)
    conf = dag_conf(settings_, "team-a", "batch_x", "file-x", "/r/in", "/v1/chat/completions", "24h", {},
                    None, ModelRoute(endpoint="http://127.0.0.1:1"), 0, "d", None, params)
    assert (conf["max_workers"], conf["concurrency"]) == (2, 8)  # the batch's own, over api_dag_conf
    assert check_pool(None, settings_.pool_limits) == {}
    with pytest.raises(ApiError) as exc:
        check_pool({"max_workers": 5}, settings_.pool_limits)
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "pool_limit_exceeded", "pool")
    assert "pool_max_workers" in exc.value.message
    with pytest.raises(ApiError) as exc:
        check_pool({"input_uri": "/etc/passwd"}, ApiSettings("/r").pool_limits)  # no other param sneaks in
    assert (exc.value.status, exc.value.code) == (400, "invalid_job_pool")


def test_the_client_checks_a_pool_before_anything_is_sent(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(POOL_YAML)
    assert pool_request(path)["memory_per_job"] == "2Gi"
    assert pool_request(str(path)) == pool_request({"max_workers": 2, "memory_per_job": "2Gi",
                                                    "gpu_policy": "spread", "requests_per_shard": 500,
                                                    "concurrency": 32})
    assert pool_request(JobPool(max_workers=1)) == {"max_workers": 1}
    assert pool_request(None) is None and pool_request({}) is None
    with pytest.raises(PoolConfigError, match="unknown key") as exc:
        pool_request({"workers": 2})
    assert exc.value.code == ExitCode.USAGE


def test_memory_per_job_is_the_driver_pods_request_and_limit() -> None:
    req = DriverPodRequest(batch_id="batch_0a750e3a913c42cf9aa498ddbbbcaf08", shard_index=0,
                           shard_uri="s3://b/s", results_prefix="s3://b/r", total_requests=1, attempt=1,
                           config=DriverConfig(endpoint="http://e:8000", deadline=2e9))
    settings_ = DriverPodSettings(memory_request="512Mi", memory_limit="1Gi", cpu_request="250m")
    plain = build_driver_pod(settings_, req, now=1e9).resources
    assert plain == {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
    sized_req = DriverPodRequest(**{**req.__dict__, "memory": "3Gi"})
    sized = build_driver_pod(settings_, sized_req, now=1e9).resources
    assert sized == {"requests": {"cpu": "250m", "memory": "3Gi"}, "limits": {"memory": "3Gi"}}


class FakeTI(SimpleNamespace):
    """What wait_for_turn reads of a task instance: its index and Airflow's count of ended ones."""

    def get_ti_count(self, dag_id, task_ids, run_ids, states):  # noqa: ANN001 - Airflow's signature
        assert (dag_id, task_ids, run_ids) == ("batch_inference", ["dispatch"], ["run-1"])
        assert set(states) == set(ENDED_STATES)
        self.asked += 1
        return self.ended


def ti(map_index: int, ended: int) -> FakeTI:
    return FakeTI(dag_id="batch_inference", task_id="dispatch", run_id="run-1", map_index=map_index,
                  ended=ended, asked=0)


def test_a_shard_whose_turn_has_not_come_is_rescheduled_not_failed() -> None:
    first = ti(1, 0)
    wait_for_turn(first, 2)  # among the first two: starts without asking
    assert first.asked == 0
    wait_for_turn(ti(5, 100), None)  # no cap
    late = ti(4, 2)  # shard 4 of max_workers 2 needs 3 ended
    before = datetime.now(UTC)
    with pytest.raises(AirflowRescheduleException) as exc:
        wait_for_turn(late, 2)
    assert late.asked == 1 and exc.value.reschedule_date >= before + timedelta(seconds=MIN_CHECK_S)
    wait_for_turn(ti(4, 3), 2)  # its turn


def test_checks_leave_the_executor_time_to_report_the_last_one() -> None:
    """A check sooner than the executor's report of the previous check's end is failed by
    Airflow's scheduler and costs a try (apache/airflow#71172; shard_turns.py): never under
    MIN_CHECK_S, which must stay well above the 9.6 s lag measured here."""
    assert MIN_CHECK_S >= 30
    assert [next_check_s(m) for m in (1, 8, 9, 10, 30)] == [MIN_CHECK_S, MIN_CHECK_S, 45.0, 50.0,
                                                            CHECK_AT_MOST_EVERY_S]


@settings(max_examples=300, deadline=None)
@given(shards=st.integers(1, 30), max_workers=st.integers(1, 6), seed_value=st.integers(0, 2**32))
def test_never_more_than_max_workers_started_and_not_ended(shards: int, max_workers: int,
                                                           seed_value: int) -> None:
    """Any scheduler order, any end order, retries included: the count never exceeds the cap,
    and every shard runs (the rule cannot deadlock)."""
    seed = random.Random(seed_value)
    waiting, running, ended = list(range(shards)), set(), 0
    peak = steps = 0
    while waiting or running:
        steps += 1
        assert steps < 10_000, "no progress: the rule deadlocked"
        if waiting and seed.random() < 0.6:  # the scheduler tries some waiting shard
            shard = seed.choice(waiting)
            if shards_to_wait_for(shard, max_workers, ended) == 0:
                waiting.remove(shard)
                running.add(shard)
        elif running:
            shard = seed.choice(sorted(running))
            running.remove(shard)
            if seed.random() < 0.2:
                waiting.append(shard)  # failed, up for retry: not ended, runs again
            else:
                ended += 1
        peak = max(peak, len(running))
    assert peak <= max_workers and ended == shards


def test_the_example_pool_file_is_one_the_defaults_accept() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "batch-pool-config.yaml"
    pool = load_pool_file(example)
    pool.check(JobPoolLimits())
    assert pool.max_workers == 2 and pool.gpu_policy == JobPoolLimits().gpu_policy
