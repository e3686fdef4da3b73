"""Permits with a changing limit, earliest deadline first (capacity/limiter.py)."""

from __future__ import annotations

import asyncio

from aibrix_operators.capacity.limiter import AdaptiveLimiter


def test_waiters_are_served_by_deadline_not_arrival() -> None:
    async def scenario() -> list[str]:
        limiter = AdaptiveLimiter(1)
        await limiter.acquire(0)
        order: list[str] = []

        async def want(name: str, deadline: float) -> None:
            await limiter.acquire(deadline)
            order.append(name)
            limiter.release()

        tasks = [asyncio.create_task(want("relaxed", 300.0)), asyncio.create_task(want("tight", 10.0)),
                 asyncio.create_task(want("moderate", 60.0))]
        await asyncio.sleep(0)
        limiter.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["tight", "moderate", "relaxed"]


def test_a_lower_limit_holds_new_permits_until_enough_come_back() -> None:
    async def scenario() -> None:
        limiter = AdaptiveLimiter(3)
        for _ in range(3):
            assert limiter.try_acquire()
        limiter.set_limit(1)
        waiter = asyncio.create_task(limiter.acquire(1.0))
        await asyncio.sleep(0)
        limiter.release()  # 2 out, limit 1: still no room
        await asyncio.sleep(0)
        assert not waiter.done()
        limiter.release()
        limiter.release()  # 0 out: the waiter gets one
        await asyncio.wait_for(waiter, 1)
        assert limiter.in_flight == 1

    asyncio.run(scenario())


def test_a_cancelled_waiter_loses_no_permit() -> None:
    async def scenario() -> None:
        limiter = AdaptiveLimiter(1)
        assert limiter.try_acquire()
        gone = asyncio.create_task(limiter.acquire(1.0))
        stays = asyncio.create_task(limiter.acquire(2.0))
        await asyncio.sleep(0)
        gone.cancel()
        limiter.release()
        await asyncio.wait_for(stays, 1)
        assert limiter.in_flight == 1 and limiter.waiting == 0

    asyncio.run(scenario())


def test_limit_zero_holds_everyone_and_a_raise_releases_them() -> None:
    async def scenario() -> None:
        limiter = AdaptiveLimiter(0)
        assert not limiter.try_acquire()
        waiters = [asyncio.create_task(limiter.acquire(float(i))) for i in range(4)]
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters) and limiter.waiting == 4
        limiter.set_limit(4)
        await asyncio.wait_for(asyncio.gather(*waiters), 1)
        assert limiter.in_flight == 4

    asyncio.run(scenario())


def _tracked_attempts(limiter: AdaptiveLimiter, n: int) -> list[asyncio.Task[None]]:
    """``n`` attempts in flight, each holding a permit and tracked (a running loop needed)."""
    attempts = [asyncio.ensure_future(asyncio.sleep(10)) for _ in range(n)]
    for a in attempts:
        assert limiter.try_acquire()
        limiter.track(a)
    return attempts


def test_preempt_takes_attempts_back_and_says_which() -> None:
    async def scenario() -> None:
        limiter = AdaptiveLimiter(4)
        attempts = _tracked_attempts(limiter, 3)
        assert limiter.preempt(2) == 2
        await asyncio.sleep(0)
        taken = [limiter.untrack(a) for a in attempts]
        assert taken.count(True) == 2 and limiter.preemptions == 2
        assert sum(a.cancelled() for a in attempts) == 2
        attempts[taken.index(False)].cancel()

    asyncio.run(scenario())


def test_preempt_takes_each_attempt_once() -> None:
    """An attempt is the sender's own task: a second cancel of it would read as somebody
    else's (a shutdown) and end the sender instead of sending the request again."""

    async def scenario() -> None:
        limiter = AdaptiveLimiter(4)
        attempts = _tracked_attempts(limiter, 2)
        assert limiter.preempt(1) == 1
        assert limiter.preempt(2) == 1  # only the one not taken yet
        await asyncio.sleep(0)
        assert [a.cancelling() for a in attempts] == [1, 1]  # one cancel each, not two
        assert limiter.preemptions == 2 and all(limiter.untrack(a) for a in attempts)

    asyncio.run(scenario())
