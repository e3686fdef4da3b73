"""Shared mode is refused against a real vLLM server that schedules first come, first served (the
suite's ``vllm_chat``): its priority field would be ignored, so online traffic could wait behind
the batch. The policy comes from the server's own middleware header, as the serving images start
it (serving/scheduling_policy.py).

Not in test_shared_capacity_vllm.py, whose tests run alone (``serial``): this one does not depend
on the server's load, and the parallel pass has ``vllm_chat`` running already, where the serial
pass would start one for it (~24 s).
"""

from __future__ import annotations

import pytest

from aibrix_operators.capacity.mode import SharedCapacity
from aibrix_operators.driver.config import DriverConfig
from aibrix_operators.driver.preflight import SharedModeRefused, check_endpoint
from aibrix_operators.serving.local_vllm import VLLMServer
from tests.integration.conftest import SERVED_NAME

pytestmark = pytest.mark.service


async def test_shared_mode_is_refused_against_a_server_that_schedules_first_come_first_served(
    vllm_chat: VLLMServer,
) -> None:
    config = DriverConfig(endpoint=vllm_chat.base_url, api_key_env=None, capacity=SharedCapacity())
    with pytest.raises(SharedModeRefused, match="policy 'fcfs'.*--scheduling-policy priority"):
        await check_endpoint(config, SERVED_NAME)
