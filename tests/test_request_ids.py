"""Per-request usage entries carry the request id support asks for: the reply's `x-request-id`
header (the fake server sends `req_<n>`, one per reply), and the completion id when the reply had
no such header (a server without it, a custom executor)."""

from __future__ import annotations

import pytest

from treadle import Session
from treadle.llm import Provider
from treadle.loop import arun_session_loop
from treadle.testing import FakeOpenAIServer, Reply, ScriptedExecutor
from wire_helpers import echo_wire

AGENT = Session.from_agent_prompt("sys")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_entry_carries_the_replys_x_request_id(stream: bool) -> None:
    with FakeOpenAIServer() as server:
        # The 503 reply is req_00000001; the retried request's reply (the one used) req_00000002.
        server.enqueue(Reply.server_error(503), Reply.text("hi"))
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=stream,
                            max_retries=1, retry_base_delay=0.0)  # fmt: skip
        out = await arun_session_loop(
            Session.from_user_message("hello"), AGENT, agent_provider=provider
        )
    [entry] = out.metadata["request_usage"]
    assert entry.request_id == "req_00000002"
    assert entry.response_id == "chatcmpl-00000002"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_without_the_header_the_entry_carries_the_completion_id(stream: bool) -> None:
    async with echo_wire() as wire:  # sends no x-request-id; its completion id is "c1"
        provider = Provider(model="m", base_url=wire.url, api_key="k", stream=stream)
        out = await arun_session_loop(
            Session.from_user_message("hello"), AGENT, agent_provider=provider
        )
    [entry] = out.metadata["request_usage"]
    assert (entry.request_id, entry.response_id) == ("c1", "c1")


async def test_a_custom_executors_entry_carries_the_completion_id() -> None:
    executor = ScriptedExecutor(["done"])
    out = await arun_session_loop(
        Session.from_user_message("hello"), AGENT, executor=executor, agent_provider=None
    )
    [entry] = out.metadata["request_usage"]
    assert entry.request_id == entry.response_id != ""
