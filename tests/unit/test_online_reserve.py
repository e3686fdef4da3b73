"""The online reserve (router/admission.py, issue 42): while online traffic is recent, batch requests
hold at most N - R slots; an online arrival withdraws the ones over that at once; the cap lifts
``online_quiet_s`` after the last online request. The class is driven as the router and the
server's middleware drive it: admit, a preemption ticket per forwarded batch request, release."""

from __future__ import annotations

import asyncio

import pytest

from aibrix_operators.router.admission import BATCH, ONLINE, Admission
from aibrix_operators.serving.online_first import ALL_SLOTS, reserve_settings


class Forwarded:
    """A batch request forwarded upstream until it ends or is taken back (then answered 429)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.ticket = admission.preemption_ticket()
        self.ended = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        await asyncio.wait((self.ticket, asyncio.ensure_future(self.ended.wait())),
                           return_when=asyncio.FIRST_COMPLETED)
        self.admission.drop_ticket(self.ticket)
        self.admission.release(BATCH)

    @property
    def withdrawn(self) -> bool:
        return self.ticket.done()


async def _forward(admission: Admission, n: int) -> list[Forwarded]:
    out = []
    for _ in range(n):
        await admission.admit(BATCH)
        out.append(Forwarded(admission))
    return out


async def test_an_online_arrival_withdraws_every_batch_request_over_the_cap_at_once() -> None:
    admission = Admission(4, online_reserve=4, online_quiet_s=0.2)
    batch = await _forward(admission, 4)
    online = asyncio.ensure_future(admission.admit(ONLINE))
    await asyncio.sleep(0)  # one loop turn: the decision is the arrival's, no tick
    assert [b.withdrawn for b in batch] == [True] * 4 and admission.shed["preempted"] == 4
    await asyncio.wait_for(online, 1)
    assert admission.inflight == {ONLINE: 1, BATCH: 0}

    # While it runs, and for the quiet time after it, a batch request waits: the steps are online's.
    waiting = asyncio.ensure_future(admission.admit(BATCH))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    admission.release(ONLINE)
    await asyncio.sleep(0.1)
    assert not waiting.done() and admission.batch_cap() == 0
    await asyncio.wait_for(waiting, 1)  # the quiet time passed: the cap lifted on its own
    assert admission.inflight[BATCH] == 1 and admission.batch_cap() == 4


async def test_a_partial_reserve_withdraws_only_what_it_needs() -> None:
    admission = Admission(3, online_reserve=1, online_quiet_s=0.2)
    batch = await _forward(admission, 3)
    await asyncio.wait_for(admission.admit(ONLINE), 1)
    assert [b.withdrawn for b in batch] == [False, False, True]  # the newest: the least work lost
    assert admission.inflight == {ONLINE: 1, BATCH: 2}
    # A second online request finds no room: it takes one more slot, as without a reserve.
    second = asyncio.ensure_future(admission.admit(ONLINE))
    await asyncio.sleep(0)
    assert [b.withdrawn for b in batch] == [False, True, True]
    await asyncio.wait_for(second, 1)
    for b in batch:
        b.ended.set()


async def test_without_a_reserve_an_online_request_takes_one_slot_only_when_full() -> None:
    admission = Admission(3)
    batch = await _forward(admission, 2)
    await asyncio.wait_for(admission.admit(ONLINE), 1)  # a free slot: nothing withdrawn
    assert not any(b.withdrawn for b in batch)
    waiting = asyncio.ensure_future(admission.admit(ONLINE))
    await asyncio.sleep(0)
    assert [b.withdrawn for b in batch] == [False, True]
    await asyncio.wait_for(waiting, 1)
    # And batch requests take freed slots at once after online ones end (no quiet time).
    admission.release(ONLINE)
    admission.release(ONLINE)
    await asyncio.wait_for(admission.admit(BATCH), 0.05)
    batch[0].ended.set()


def test_bad_reserves_are_refused_saying_what_is_wanted() -> None:
    with pytest.raises(ValueError, match="online_reserve must be between 0 and the 2 slots"):
        Admission(2, online_reserve=3)
    with pytest.raises(ValueError, match="online_quiet_s"):
        Admission(2, online_quiet_s=-1)
    assert reserve_settings({}) == {}
    assert reserve_settings({"AIBRIX_ONLINE_RESERVE": "all", "AIBRIX_ONLINE_QUIET_S": "0.5"}) == {
        "online_reserve": ALL_SLOTS, "online_quiet_s": 0.5}
    for env in ({"AIBRIX_ONLINE_RESERVE": "lots"}, {"AIBRIX_ONLINE_QUIET_S": "-2"},
                {"AIBRIX_ONLINE_RESERVE": "-3"}):
        with pytest.raises(ValueError, match="AIBRIX_ONLINE_RESERVE="):
            reserve_settings(env)
