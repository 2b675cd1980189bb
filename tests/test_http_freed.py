"""Connections cost little memory: closed ones are freed by reference counting, not left for
the garbage collector, and open ones share their thread's read buffer.

Issue 33: each closed connection stayed in a reference cycle with its own parser (the parser holds
the connection's bound callbacks) and kept its 64 KiB read buffer until a full collection; a
fan-out of 10,000 passes closed about 3,600 of them."""

from __future__ import annotations

import asyncio
import gc
import weakref

from treadle._http.pool import Pool
from treadle._http.reply import Timeouts
from treadle.testing import FakeOpenAIServer

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
HEADERS = {"content-type": "application/json", "authorization": "Bearer k"}


async def _closed_connection_refs(url: str) -> list[weakref.ref[object]]:
    pool = Pool()
    replies = await asyncio.gather(*(pool.post(url, BODY, HEADERS, Timeouts(10, 10, 10))
                                     for _ in range(3)))  # fmt: skip
    assert [r.status for r in replies] == [200] * 3
    refs: list[weakref.ref[object]] = [weakref.ref(conn) for conn in pool._all]
    assert len(refs) == 3
    # One 64 KiB read buffer for the loop's connections, not one each (issue 33).
    assert len({id(conn._buffer.obj) for conn in pool._all}) == 1
    await pool.aclose()
    for _ in range(20):  # connection_lost runs once the transports finished closing
        if all(ref() is None for ref in refs):
            break
        await asyncio.sleep(0.01)
    return refs


def test_a_closed_connection_is_freed_without_the_collector() -> None:
    with FakeOpenAIServer(script="echo") as server:
        gc.collect()
        gc.disable()  # only reference counting may free them
        try:
            refs = asyncio.run(_closed_connection_refs(f"{server.base_url}/chat/completions"))
            alive = sum(ref() is not None for ref in refs)
        finally:
            gc.enable()
    assert alive == 0
