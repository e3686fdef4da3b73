"""Engine time (driver/engine_time.py): a shard is charged its share of the endpoint's tokens while it
ran, read from the endpoint's own vLLM counters (the fake serves them as vLLM names them), never more
than its wall time, and nothing when the endpoint does not say."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from aibrix_operators.batch.cost import Prices, cost_line, describe
from aibrix_operators.driver.engine_time import engine_seconds
from aibrix_operators.operators.batch_end import engine_time
from tests.driver.test_driver_faults import run

ANSWER = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "fault": ["ok@0.01"]}


def test_the_share_is_the_shards_tokens_over_what_the_endpoint_served() -> None:
    assert engine_seconds(1000.0, 3000.0, 500, 10.0) == 2.5  # a quarter of the tokens: a quarter of 10 s
    assert engine_seconds(0.0, 100.0, 400, 10.0) == 10.0  # never more than the wall time
    assert engine_seconds(None, 100.0, 10, 10.0) is None  # no counters: no figure, never a guess
    assert engine_seconds(500.0, 100.0, 10, 10.0) is None  # counters went back: a restarted server
    # The batch's figure is the sum of its shard runs', or none when one run could not measure.
    assert engine_time([{"engine_s": 1.5}, {"engine_s": 2.25}]) == 3.75
    assert engine_time([{"engine_s": 1.5}, {"engine_s": None}]) is None and engine_time([]) is None


def test_an_engine_hour_is_priced_when_the_deployment_sets_gpu_hour() -> None:
    usage = {"input_tokens": 0, "output_tokens": 0}
    line = cost_line(usage, Prices(input=1, output=1, gpu_hour=3.6), engine_s=1800.0)
    assert (line["engine_hours"], line["engine"], line["total"]) == (0.5, 1.8, 1.8)
    assert "engine 1.800000 for 0.5000 h" in describe(line)
    unpriced = cost_line(usage, Prices(input=1, output=1), engine_s=1800.0)
    assert "engine" not in unpriced and unpriced["engine_hours"] == 0.5 and unpriced["total"] == 0.0


@pytest.mark.parametrize("others", [0, 4])
async def test_a_shard_is_charged_its_share_of_a_shared_endpoint(tmp_path, fault_server, make_request,
                                                                 others: int) -> None:
    """The shard sends 300 requests, 4 at a time; ``others`` clients of another tenant send the same
    kind of requests to the same endpoint throughout: alone it is charged (about) its whole sending
    time, beside as many others about half of it."""
    stop = threading.Event()

    def other_tenant() -> None:
        with httpx.Client(base_url=fault_server.url) as client:
            while not stop.is_set():
                client.post("/v1/chat/completions", json={**ANSWER, "cid": "other"})

    threads = [threading.Thread(target=other_tenant) for _ in range(others)]
    for t in threads:
        t.start()
    try:
        await asyncio.sleep(0.3 if others else 0)  # the other tenant is already there
        outcome, _ = await run(tmp_path, fault_server, [make_request(f"e{i}", "ok@0.01") for i in range(300)])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert outcome.completed == 300 and outcome.engine_s is not None
    share = outcome.engine_s / outcome.elapsed_s
    if others == 0:
        assert 0.8 <= share <= 1.0, share  # all of the endpoint's tokens were the shard's
    else:
        assert 0.25 <= share <= 0.75, share  # half of them, give or take the clients' pace
