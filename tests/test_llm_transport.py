"""The transport seam (`treadle.llm.transport`): Treadle's pool and a user's `httpx.AsyncClient`
behind the same two calls, with the same `treadle._http` errors, incremental streaming, and
cancellation that closes connections without leaks. Each test runs over both transports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from net_helpers import cancel_held_requests, unanswered_port
from treadle._http.errors import (
    BodyClosed,
    ConnectError,
    ConnectTimeout,
    ReadTimeout,
    RemoteProtocolError,
)
from treadle._http.reply import Timeouts
from treadle.llm.transport import HttpxTransport, PoolTransport, Transport
from treadle.testing import FakeOpenAIServer, Reply

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
STREAM_BODY = BODY[:-1] + b',"stream":true}'
HEADERS = {"content-type": "application/json"}
T = Timeouts(5.0, 5.0, 5.0)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer("echo") as srv:
        yield srv


@pytest.fixture(params=["pool", "httpx"])
async def transport(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    if request.param == "pool":
        pool = PoolTransport()
        yield pool
        await pool.aclose()
    else:
        async with httpx.AsyncClient() as http:
            yield HttpxTransport(http)


def chat_url(server: FakeOpenAIServer) -> str:
    return f"{server.base_url}/chat/completions"


async def test_whole_replies_and_connections_reused(
    server: FakeOpenAIServer, transport: Transport
) -> None:
    for _ in range(5):
        reply = await transport.post(chat_url(server), BODY, HEADERS, T)
        assert reply.status == 200 and b"choices" in reply.content
        assert reply.headers["Content-Type"] == "application/json"
    assert len(server._connections) == 1  # keep-alive: one connection for sequential requests


async def test_sse_bodies_stream_incrementally(
    server: FakeOpenAIServer, transport: Transport
) -> None:
    server.enqueue(Reply.text("x" * 64, chunk_chars=8).stalled(5000))
    reply = await transport.post_stream(chat_url(server), STREAM_BODY, HEADERS, T)
    assert reply.headers["content-type"] == "text/event-stream"
    first = await anext(reply.body.__aiter__())
    assert first.startswith(b"data: ")  # arrived while the server still stalls the rest
    await reply.body.aclose()
    with pytest.raises(BodyClosed):  # a closed body refuses reads (it holds no connection)
        await anext(reply.body.__aiter__())


async def test_refused_is_connect_error(transport: Transport) -> None:
    with pytest.raises(ConnectError):
        await transport.post("http://127.0.0.1:9/", BODY, HEADERS, T)


@pytest.mark.parametrize("fault", [Reply.dropped_connection(), Reply.text("a" * 200).torn(1)])
async def test_disconnect_and_truncated_body_are_remote_protocol_errors(
    server: FakeOpenAIServer, transport: Transport, fault: Reply
) -> None:
    server.enqueue(fault)
    with pytest.raises(RemoteProtocolError):
        await transport.post(chat_url(server), BODY, HEADERS, T)


async def test_torn_sse_stream_is_remote_protocol_error(
    server: FakeOpenAIServer, transport: Transport
) -> None:
    server.enqueue(Reply.text("y" * 80, chunk_chars=4).torn(3))
    reply = await transport.post_stream(chat_url(server), STREAM_BODY, HEADERS, T)
    with pytest.raises(RemoteProtocolError):
        async for _ in reply.body:
            pass
    await reply.body.aclose()


@pytest.mark.parametrize(
    "fault",
    [Reply.text("late").with_latency(3000), Reply.text("b" * 300).stalled(3000)],
    ids=["before-headers", "mid-body"],
)
async def test_read_timeouts(server: FakeOpenAIServer, transport: Transport, fault: Reply) -> None:
    server.enqueue(fault)
    with pytest.raises(ReadTimeout):
        await transport.post(chat_url(server), BODY, HEADERS, Timeouts(5, 0.1, 5))


async def test_read_timeout_mid_stream(server: FakeOpenAIServer, transport: Transport) -> None:
    server.enqueue(Reply.text("z" * 50, chunk_chars=5).stalled(3000))
    reply = await transport.post_stream(chat_url(server), STREAM_BODY, HEADERS, Timeouts(5, 0.1, 5))
    with pytest.raises(ReadTimeout):
        async for _ in reply.body:
            pass
    await reply.body.aclose()


async def test_connect_timeout(transport: Transport) -> None:
    with unanswered_port() as port, pytest.raises(ConnectTimeout):
        await transport.post(f"http://127.0.0.1:{port}/", BODY, HEADERS, Timeouts(0.2, 5, 5))


async def test_cancellation_closes_connections_and_transport_stays_usable(
    server: FakeOpenAIServer, transport: Transport
) -> None:
    async def send() -> int:
        return (await transport.post(chat_url(server), BODY, HEADERS, T)).status

    await cancel_held_requests(server, send)


async def test_the_pool_is_bound_to_its_loop() -> None:
    transport = PoolTransport()
    with pytest.raises(ConnectError):
        await transport.post("http://127.0.0.1:9/", BODY, HEADERS, T)
    assert transport.pool is not None and not transport.pool.closed
    await transport.aclose()
    assert transport.pool is None
    with pytest.raises(RuntimeError, match="closed"):
        await transport.post("http://127.0.0.1:9/", BODY, HEADERS, T)
