"""A reused keep-alive connection closed before any response byte within milliseconds of the write
(a stale connection) is re-sent once, at once, without using up `max_retries` (llama.cpp's server
closes connections after streaming), but never with `max_retries=0`: that always means one send.
A fresh connection closed the same way is not: the server may have processed (and billed) that
request, so only `max_retries` may send it again."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from treadle import ProviderConnectionError, ProviderError, Session
from treadle._http import protocol
from treadle.llm import ModelClient, Provider, build_request_body, get_client
from treadle.loop import arun_session_loop
from treadle.testing import FakeOpenAIServer, Reply
from wire_helpers import chunk, completion, event

AGENT = Session.from_agent_prompt("sys")


def _provider(server: FakeOpenAIServer, *, stream: bool = False, retries: int = 0) -> Provider:
    return Provider(model="m", base_url=server.base_url, api_key="k", max_retries=retries,
                    retry_base_delay=0.001, stream=stream)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_one_dropped_connection_is_retried(stream: bool) -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server, stream=stream, retries=1)
        first = await arun_session_loop(
            Session.from_user_message("warm the pool"), AGENT, agent_provider=provider
        )
        assert first.stop_reason == "final_answer"
        server.enqueue(Reply.dropped_connection())  # the pooled connection dies unanswered
        out = await arun_session_loop(
            Session.from_user_message("again"), AGENT, agent_provider=provider
        )
        assert out.stop_reason == "final_answer"
        assert "again" in (out.final_text or "")
        assert server.request_count == 3  # warm-up, the dropped one, the immediate retry


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stale_drop_is_never_resent_with_max_retries_0(stream: bool) -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server, stream=stream)
        body = build_request_body(provider, [b'{"role":"user","content":"x"}'], stream=stream)
        client = get_client(provider)
        await _send(client, provider, body, stream)  # warm the pool: the drops hit a reused one
        server.reset_stats()
        server.enqueue(Reply.dropped_connection(), Reply.dropped_connection())
        with pytest.raises(ProviderConnectionError):
            if stream:
                async for _ in client.stream(provider, body):
                    pass
            else:
                await client.complete(provider, body)
        assert server.request_count == 1  # max_retries=0: one send, even on a stale connection


@pytest.mark.parametrize("stream", [False, True])
async def test_sequential_requests_reuse_one_pooled_connection(stream: bool) -> None:
    # Whole and streamed replies alike leave their connection in the pool for the next request.
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server, stream=stream)
        for i in range(20):
            out = await arun_session_loop(
                Session.from_user_message(f"turn {i}"), AGENT, agent_provider=provider
            )
            assert out.stop_reason == "final_answer"
        assert server.request_count == 20
        assert server.connections_opened == 1


async def _send(client: ModelClient, provider: Provider, body: bytes, stream: bool) -> None:
    if stream:
        async for _ in client.stream(provider, body):
            pass
    else:
        await client.complete(provider, body)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_fresh_connection_dropped_is_not_resent_with_max_retries_0(stream: bool) -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server, stream=stream)  # max_retries=0
        server.enqueue(Reply.dropped_connection())
        body = build_request_body(provider, [b'{"role":"user","content":"x"}'], stream=stream)
        with pytest.raises(ProviderConnectionError):
            await _send(get_client(provider), provider, body, stream)
        assert server.request_count == 1  # the server got it once: it is never sent twice
        assert server.connections_opened == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_fresh_connection_dropped_counts_as_a_retry(stream: bool) -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", max_retries=1,
                            retry_base_delay=0.001, stream=stream)  # fmt: skip
        server.enqueue(Reply.dropped_connection(), Reply.dropped_connection())
        body = build_request_body(provider, [b'{"role":"user","content":"x"}'], stream=stream)
        with pytest.raises(ProviderConnectionError, match="after 1 retry"):
            await _send(get_client(provider), provider, body, stream)
        assert server.request_count == 2  # the first send and its one counted retry


async def test_a_dropped_fresh_connection_beside_a_pooled_one_is_not_stale() -> None:
    # Two concurrent requests: one reuses the pooled connection, the other must open a new
    # one; a drop on the new one is not a stale keep-alive connection.
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server)
        body = build_request_body(provider, [b'{"role":"user","content":"x"}'], stream=False)
        client = get_client(provider)
        await client.complete(provider, body)
        server.reset_stats()
        server.add_fault(Reply.dropped_connection(), when=lambda r: "drop" in str(r), times=1)
        dropped = build_request_body(provider, [b'{"role":"user","content":"drop"}'], stream=False)
        fine = build_request_body(provider, [b'{"role":"user","content":"slow"}'], stream=False)
        results = await asyncio.gather(
            client.complete(provider, fine), client.complete(provider, dropped),
            return_exceptions=True,
        )  # fmt: skip
        assert not isinstance(results[0], BaseException)
        assert isinstance(results[1], ProviderConnectionError)
        assert server.request_count == 2  # the dropped one was not sent again


# -- the free re-send, deterministically ----------------------------------------------------------
# Whether a close counts as stale depends on the time between the write and the close (5 ms): on
# a loaded machine that is a race. These tests set the window (a module constant of the HTTP
# layer, not a mock) to "always" or "never", and a server closes a kept-alive connection as the
# next request arrives on it; what they check is the number of requests the server saw.

CLOSE = "close"


@contextlib.asynccontextmanager
async def closing_server(script: list[int | str]) -> AsyncIterator[tuple[str, list[int]]]:
    """Answers the n-th request per `script`: a status, or CLOSE (drop the connection unanswered).

    Yields (base URL, the connection number of each request seen)."""
    seen: list[int] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        conn = connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))  # fmt: skip
                body = json.loads(await reader.readexactly(length))
                step = script[len(seen)] if len(seen) < len(script) else 200
                seen.append(conn)
                if step == CLOSE:
                    return
                if step != 200:
                    writer.write(b"HTTP/1.1 %d Busy\r\ncontent-length: 2\r\n\r\n{}" % step)
                elif body.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n"
                                 + chunk(event("ok", "stop")) + chunk(b"data: [DONE]\n\n")
                                 + b"0\r\n\r\n")  # fmt: skip
                else:
                    whole = completion("ok")
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%b" % (len(whole), whole))  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", seen
    finally:
        server.close()


async def _warm_then_send(base: str, stream: bool, retries: int) -> None:
    provider = Provider(model="m", base_url=base, api_key="k", max_retries=retries,
                        retry_base_delay=0.001, stream=stream)  # fmt: skip
    body = build_request_body(provider, [b'{"role":"user","content":"x"}'], stream=stream)
    client = get_client(provider)
    await _send(client, provider, body, stream)  # the connection is pooled, then reused
    await _send(client, provider, body, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stale_close_is_resent_once_without_spending_a_retry(
    stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol, "STALE_WINDOW_SECONDS", 3600.0)  # every such close is stale
    # warm-up; the reused connection closes (free re-send); a 503 (the one retry); success.
    async with closing_server([200, CLOSE, 503, 200]) as (base, seen):
        await _warm_then_send(base, stream, retries=1)
    assert seen == [1, 1, 2, 2]  # with the re-send counted, the 503 would have been final


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stale_close_is_never_resent_with_max_retries_0(
    stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol, "STALE_WINDOW_SECONDS", 3600.0)
    async with closing_server([200, CLOSE]) as (base, seen):
        with pytest.raises(ProviderConnectionError):
            await _warm_then_send(base, stream, retries=0)
    assert seen == [1, 1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_close_outside_the_window_spends_a_retry(
    stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol, "STALE_WINDOW_SECONDS", -1.0)  # never stale: the server may
    # have worked on (and billed) the request, so only max_retries may send it again
    async with closing_server([200, CLOSE, 503, 200]) as (base, seen):
        with pytest.raises(ProviderError, match="after 1 retry") as caught:
            await _warm_then_send(base, stream, retries=1)
    assert caught.value.status_code == 503
    assert seen == [1, 1, 2]
