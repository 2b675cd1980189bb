"""Network fixtures shared by the transport tests."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from collections.abc import Awaitable, Callable, Iterator

from treadle.testing import FakeOpenAIServer


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose listener has a full accept backlog: the kernel drops further SYNs,
    so a connect to it hangs (until the client's connect timeout)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.05)  # the fillers' handshakes settle into the backlog
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def cancel_held_requests(
    server: FakeOpenAIServer, send: Callable[[], Awaitable[int]]
) -> None:
    """Start 50 requests the server holds, cancel them all, then check the client still works
    (`send()` returns a status) and every cancelled request's connection was closed."""
    server.latency_ms = 10_000
    tasks = [asyncio.create_task(send()) for _ in range(50)]
    await _eventually(lambda: server.in_flight == 50)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    server.latency_ms = 0
    for _ in range(5):
        assert await send() == 200
    # the server sees the cancelled requests' connections closed
    await _eventually(lambda: len(server._connections) <= 1 and server.in_flight == 0)
    gc.collect()  # an unclosed transport would raise ResourceWarning here (warnings are errors)


async def _eventually(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and Content-Length body) off a raw connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)
