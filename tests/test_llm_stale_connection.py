"""A connection closed before any response byte (a stale keep-alive connection) is retried once,
at once, without using up `max_retries` (llama.cpp's server closes connections after streaming)."""

from __future__ import annotations

import pytest

from treadle import ProviderConnectionError, Session
from treadle.llm import Provider, build_request_body, get_client
from treadle.loop import arun_session_loop
from treadle.testing import FakeOpenAIServer, Reply

AGENT = Session.from_agent_prompt("sys")


def _provider(server: FakeOpenAIServer, *, stream: bool = False) -> Provider:
    return Provider(model="m", base_url=server.base_url, api_key="k", max_retries=0, stream=stream)


@pytest.mark.parametrize("stream", [False, True])
async def test_one_dropped_connection_is_retried_without_counting(stream: bool) -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server, stream=stream)
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
async def test_a_second_drop_is_an_ordinary_connection_error(stream: bool) -> None:
    with FakeOpenAIServer(script="echo") as server:
        provider = _provider(server, stream=stream)
        server.enqueue(Reply.dropped_connection(), Reply.dropped_connection())
        body = build_request_body(provider, [b'{"role":"user","content":"x"}'], stream=stream)
        client = get_client(provider)
        with pytest.raises(ProviderConnectionError):
            if stream:
                async for _ in client.stream(provider, body):
                    pass
            else:
                await client.complete(provider, body)
        assert server.request_count == 2  # one free retry, then max_retries=0 applies


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
