"""A batch line's own ``priority`` never reaches the server (review 2026-12-05, finding 2).

On a dedicated endpoint the driver sent a line's ``priority`` unchanged: ``-2147483648`` reached a
server run with ``--scheduling-policy priority`` (both Kubernetes overlays), so one tenant's batch
jumped every other's, and the router's online-first admission took it for online traffic. The
driver sends to a real aiohttp server that records every body; every request carries the
deployment's priority (driver/priority.py). Shared mode's batch priority on the wire is
tests/capacity (the limiter's tests) and tests/integration/test_shared_capacity_vllm.py."""

from __future__ import annotations

from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.priority import DEDICATED_PRIORITY, prioritized_body
from aibrix_operators.driver.runner import run_shard
from aibrix_operators.storage import LocalStorage
from tests.driver.test_cache_salt import by_marker, line, server  # noqa: F401 - the fixture
from tests.driver.test_driver_faults import results_by_id, write_shard

LINES = [
    line("none"),
    line("lowest", priority=-(2**31)),
    line("negative", priority=-1),
    line("higher", priority=7),
    line("zero", priority=0),
    line("not-an-int", priority="-5"),
    line("embedding", url="/v1/embeddings", input="x", priority=-100),
]


async def test_a_lines_own_priority_is_replaced_by_the_deployments(server, tmp_path) -> None:  # noqa: F811
    storage, shard = LocalStorage(), write_shard(tmp_path, LINES)
    cfg = DriverConfig(server.url, concurrency=2, flush_interval_s=0.05, api_key_env=None)
    await run_shard(storage, shard, str(tmp_path / "results"), cfg)
    seen = by_marker(server)
    assert sorted(results_by_id(storage, str(tmp_path / "results"), shard)) == sorted(
        r["custom_id"] for r in LINES)
    assert {marker: body["priority"] for marker, body in seen.items()} == {
        r["custom_id"]: DEDICATED_PRIORITY for r in LINES}
    # Nothing else of the line changed.
    assert seen["embedding"]["input"] == "x" and seen["lowest"]["messages"] == []


def test_the_shared_priority_replaces_any_value_and_keeps_the_line() -> None:
    own = {"model": "m", "priority": -(2**31)}
    assert prioritized_body(own, 10) == {"model": "m", "priority": 10}
    assert own["priority"] == -(2**31)  # the line's dict is not changed in place
    assert prioritized_body({"model": "m", "priority": True}, 1)["priority"] is not True
    already = {"model": "m", "priority": 0}
    assert prioritized_body(already, 0) is already
