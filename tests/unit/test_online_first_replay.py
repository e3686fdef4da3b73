"""What the online-first middleware hands vLLM as ``receive`` (serving/online_first.py): the body it
already read, then the client's messages, or a disconnect once the request is taken back."""

from __future__ import annotations

import asyncio

from aibrix_operators.serving.online_first import _replaying

BODY = {"type": "http.request", "body": b"{}", "more_body": False}


async def test_the_read_body_first_then_the_clients_own_messages() -> None:
    client: asyncio.Queue[dict] = asyncio.Queue()
    replay = _replaying([BODY], client.get, asyncio.Event())
    assert await replay() == BODY
    await client.put({"type": "http.disconnect"})  # the client itself left
    assert await replay() == {"type": "http.disconnect"}


async def test_a_request_taken_back_reads_as_its_client_gone() -> None:
    client: asyncio.Queue[dict] = asyncio.Queue()  # the client says nothing
    gone = asyncio.Event()
    replay = _replaying([BODY], client.get, gone)
    await replay()
    waiting = asyncio.ensure_future(replay())
    await asyncio.sleep(0)
    gone.set()
    assert await asyncio.wait_for(waiting, 1) == {"type": "http.disconnect"}
    assert await replay() == {"type": "http.disconnect"}  # and stays so


async def test_a_receive_the_app_stops_waiting_for_leaves_no_task_behind() -> None:
    """vLLM cancels its disconnect listener once the handler has answered: the two tasks the
    receive waits on must go with it (left pending, the garbage collector destroyed them later,
    each a "Task was destroyed but it is pending!" line in the server's log)."""
    client: asyncio.Queue[dict] = asyncio.Queue()
    replay = _replaying([BODY], client.get, asyncio.Event())
    await replay()
    before = asyncio.all_tasks()
    listener = asyncio.ensure_future(replay())
    await asyncio.sleep(0.01)
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    await asyncio.sleep(0)
    assert not [t for t in asyncio.all_tasks() - before if not t.done()]
