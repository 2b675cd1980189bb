"""AiohttpTransport: httpx's error classes, incremental streaming, cancellation without leaks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from net_helpers import cancel_held_requests, unanswered_port
from treadle.llm import AiohttpTransport
from treadle.testing import FakeOpenAIServer, Reply

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer("echo") as srv:
        yield srv


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=AiohttpTransport(), timeout=5.0) as http:
        yield http


def chat_url(server: FakeOpenAIServer) -> str:
    return f"{server.base_url}/chat/completions"


async def test_small_bodies_are_buffered_and_connections_reused(
    server: FakeOpenAIServer, client: httpx.AsyncClient
) -> None:
    for _ in range(5):
        response = await client.post(chat_url(server), content=BODY)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]
    assert len(server._connections) == 1  # keep-alive: one connection for sequential requests
    health = await client.get(server.base_url.replace("/v1", "/health"))
    assert health.json() == {"status": "ok"}


async def test_sse_bodies_stream_incrementally(
    server: FakeOpenAIServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(Reply.text("x" * 64, chunk_chars=8).stalled(5000))
    body = BODY[:-1] + b',"stream":true}'
    async with client.stream("POST", chat_url(server), content=body) as response:
        assert response.headers["content-type"] == "text/event-stream"
        first = await anext(response.aiter_bytes())
        assert first.startswith(b"data: ")  # arrived while the server still stalls the rest


async def test_refused_is_connect_error(client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.ConnectError):
        await client.get("http://127.0.0.1:9/")


@pytest.mark.parametrize("fault", [Reply.dropped_connection(), Reply.text("a" * 200).torn(1)])
async def test_disconnect_and_truncated_body_are_remote_protocol_errors(
    server: FakeOpenAIServer, client: httpx.AsyncClient, fault: Reply
) -> None:
    server.enqueue(fault)
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post(chat_url(server), content=BODY)


async def test_torn_sse_stream_is_remote_protocol_error(
    server: FakeOpenAIServer, client: httpx.AsyncClient
) -> None:
    server.enqueue(Reply.text("y" * 80, chunk_chars=4).torn(3))
    body = BODY[:-1] + b',"stream":true}'
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", chat_url(server), content=body) as response:
            async for _ in response.aiter_bytes():
                pass


@pytest.mark.parametrize(
    "fault",
    [Reply.text("late").with_latency(3000), Reply.text("b" * 300).stalled(3000)],
    ids=["before-headers", "mid-body"],
)
async def test_read_timeouts(
    server: FakeOpenAIServer, client: httpx.AsyncClient, fault: Reply
) -> None:
    server.enqueue(fault)
    with pytest.raises(httpx.ReadTimeout):
        await client.post(chat_url(server), content=BODY, timeout=httpx.Timeout(5, read=0.1))


async def test_read_timeout_mid_stream(server: FakeOpenAIServer, client: httpx.AsyncClient) -> None:
    server.enqueue(Reply.text("z" * 50, chunk_chars=5).stalled(3000))
    body = BODY[:-1] + b',"stream":true}'
    with pytest.raises(httpx.ReadTimeout):
        async with client.stream(
            "POST", chat_url(server), content=body, timeout=httpx.Timeout(5, read=0.1)
        ) as response:
            async for _ in response.aiter_bytes():
                pass


async def test_connect_timeout(client: httpx.AsyncClient) -> None:
    with unanswered_port() as port, pytest.raises(httpx.ConnectTimeout):
        await client.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(5, connect=0.2))


async def test_cancellation_closes_connections_and_client_stays_usable(
    server: FakeOpenAIServer, client: httpx.AsyncClient
) -> None:
    async def send() -> int:
        return (await client.post(chat_url(server), content=BODY)).status_code

    await cancel_held_requests(server, send)


async def test_transport_is_bound_to_its_loop() -> None:
    transport = AiohttpTransport()
    async with httpx.AsyncClient(transport=transport) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get("http://127.0.0.1:9/")
        assert transport.session is not None and not transport.session.closed
    assert transport.session is None
