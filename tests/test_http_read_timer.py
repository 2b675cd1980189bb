"""The read timer of a kept-alive connection (`treadle._http.protocol.Connection`).

One timer is armed per connection, not per request: it stays armed from one reply to the next
and re-arms itself from the time of the last byte when it fires (docs/performance.md, "Streamed
rounds: two trims of a round"). What that must not change: every request's read timeout holds,
also a shorter one than the request before it had, also after the timer fired while the
connection sat idle in the pool. Real sockets on loopback: a raw asyncio server that counts its
connections and answers each request after the delay the test queued for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from net_helpers import read_request
from treadle._http.errors import ReadTimeout
from treadle._http.pool import Pool
from treadle._http.protocol import Connection
from treadle._http.reply import Timeouts

BODY = b'{"model":"m","messages":[]}'
HEADERS = {"content-type": "application/json"}
REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Delayed:
    """A keep-alive server answering request i after `delays[i]` seconds (0 past the list)."""

    def __init__(self, delays: list[float]) -> None:
        self.delays = delays
        self.connections = 0
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await read_request(reader)
                index, self.requests = self.requests, self.requests + 1
                delay = self.delays[index] if index < len(self.delays) else 0.0
                await asyncio.sleep(delay)
                writer.write(REPLY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(delays: list[float]) -> AsyncIterator[tuple[Delayed, str]]:
    srv_state = Delayed(delays)
    srv = await asyncio.start_server(srv_state.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield srv_state, f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        srv.close()


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    lane = Pool()
    yield lane
    await lane.aclose()


def only_connection(pool: Pool) -> Connection:
    (conn,) = pool._all
    return conn


async def test_a_kept_alive_connection_keeps_its_read_timer(pool: Pool) -> None:
    async with serving([]) as (srv, url):
        await pool.post(url, BODY, HEADERS, Timeouts(5, 30, 5))
        timer = only_connection(pool)._timer
        assert timer is not None and not timer.cancelled()  # kept armed while idle
        await pool.post(url, BODY, HEADERS, Timeouts(5, 30, 5))
        assert only_connection(pool)._timer is timer  # the same timer served the second reply
        assert srv.connections == 1


async def test_a_shorter_read_timeout_on_a_reused_connection_holds(pool: Pool) -> None:
    # The first request leaves a timer due in 30 s; the second allows 0.1 s and its reply
    # comes after 3 s: a timer kept as it was would let the late reply through.
    async with serving([0.0, 3.0]) as (srv, url):
        await pool.post(url, BODY, HEADERS, Timeouts(5, 30, 5))
        with pytest.raises(ReadTimeout):
            await pool.post(url, BODY, HEADERS, Timeouts(5, 0.1, 5))
        assert srv.connections == 1  # it was the reused connection that timed out
        reply = await pool.post(url, BODY, HEADERS, Timeouts(5, 30, 5))
        assert reply.status == 200


async def test_a_timer_that_fired_while_idle_is_armed_again(pool: Pool) -> None:
    async with serving([0.0, 0.0, 3.0]) as (srv, url):
        await pool.post(url, BODY, HEADERS, Timeouts(5, 0.05, 5))
        await asyncio.sleep(0.3)  # the kept timer fires while the connection is idle
        conn = only_connection(pool)
        assert conn._timer is None and not conn.closed  # it ended; the connection is intact
        reply = await pool.post(url, BODY, HEADERS, Timeouts(5, 0.05, 5))
        assert reply.status == 200 and srv.connections == 1
        with pytest.raises(ReadTimeout):  # and a timeout still holds on it after that
            await pool.post(url, BODY, HEADERS, Timeouts(5, 0.05, 5))


async def test_a_request_without_a_read_timeout_drops_the_kept_timer(pool: Pool) -> None:
    async with serving([0.0, 0.3]) as (srv, url):
        await pool.post(url, BODY, HEADERS, Timeouts(5, 0.05, 5))
        # No read timeout on this one: the 0.05 s timer kept from the first must not fire on it.
        reply = await pool.post(url, BODY, HEADERS, Timeouts(5, None, 5))
        assert reply.status == 200 and srv.connections == 1
        assert only_connection(pool)._timer is None


@pytest.mark.parametrize("closing", ["the pool", "the connection"])
async def test_closing_cancels_the_kept_timer_at_once(pool: Pool, closing: str) -> None:
    async with serving([]) as (_, url):
        await pool.post(url, BODY, HEADERS, Timeouts(5, 30, 5))
        conn = only_connection(pool)
        timer = conn._timer
        assert timer is not None
        if closing == "the pool":
            await pool.aclose()
        else:
            conn.close()
        # At the close itself, not at `connection_lost`, a loop turn later: over TLS a peer that
        # never answers the close_notify holds that back for up to 30 s (ssl_shutdown_timeout).
        assert timer.cancelled() and conn._timer is None
