"""Treadle against a real model server: llama.cpp serving Gemma 3 270M on CPU.

Assertions are about the shape of the traffic and of the transcript (finish reasons, row kinds,
tool-call structure, error classes), never the model's wording. The prompt is the one verified
to make this small base model call the tool ("Add 2 and 3 using the add tool.").
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_core import to_json

from treadle import Session
from treadle.errors import ContextLengthError
from treadle.llm import (
    ChatCompletion,
    Provider,
    StreamAccumulator,
    aclose_clients,
    build_request_body,
    get_client,
)
from treadle.loop import run_session_loop
from treadle.persist import load_session
from treadle.testing.local_model import DEFAULT_CONTEXT_TOKENS, LocalModelServer, run_demo
from treadle.tools import tool

pytestmark = pytest.mark.e2e

PROMPT = "Add 2 and 3 using the add tool."
AGENT = Session.from_agent_prompt("You are a helpful assistant. Use the tools you are given.")
ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return the sum.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture
async def closing_clients() -> AsyncIterator[None]:
    """Close the pooled clients of the test's loop when the test ends."""
    yield
    await aclose_clients()


def _messages(*messages: dict[str, Any]) -> list[bytes]:
    return [to_json(m) for m in messages]


async def _ask(
    provider: Provider, messages: list[bytes], *, stream: bool, tools: bool = True
) -> ChatCompletion:
    schemas = to_json([ADD_SCHEMA]) if tools else None
    body = build_request_body(provider, messages, schemas, stream=stream)
    client = get_client(provider)
    if not stream:
        return await client.complete(provider, body)
    acc = StreamAccumulator()
    async for chunk in client.stream(provider, body):
        acc.add(chunk)
    return acc.result()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_tool_round_then_final_answer(
    local_server: LocalModelServer, closing_clients: None, stream: bool
) -> None:
    provider = local_server.provider()
    user = {"role": "user", "content": PROMPT}
    first = await _ask(provider, _messages(user), stream=stream)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "add" and calls[0].id
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"a", "b"}
    assert all(isinstance(v, int) for v in arguments.values())

    assistant = choice.message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": calls[0].id, "content": str(sum(arguments.values()))}
    second = await _ask(provider, _messages(user, assistant, result), stream=stream)
    answer = second.choices[0]
    assert answer.finish_reason == "stop"
    assert not answer.message.tool_calls
    assert (answer.message.content or "").strip()
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def _add_tool(calls: list[tuple[int, int]]) -> Any:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        calls.append((a, b))
        return a + b

    return add


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_session_loop_with_a_custom_add_tool(
    local_server: LocalModelServer, tmp_path: Path, stream: bool
) -> None:
    calls: list[tuple[int, int]] = []
    deltas: list[Any] = []
    out = run_session_loop(
        Session.from_user_message(PROMPT),
        AGENT,
        agent_provider=local_server.provider(stream=stream),
        tools=[_add_tool(calls)],
        on_event=deltas.append,
        persist_path=tmp_path,
        max_tool_rounds=4,
    )
    assert out.stop_reason == "final_answer"
    rows = out.rows
    assert [r.kind for r in rows] == ["user", "assistant", "tool_result", "assistant"]
    assert rows[1].tool_calls[0]["function"]["name"] == "add"
    assert len(calls) == 1
    result = json.loads(rows[2].payload["content"])
    assert rows[2].payload["tool_call_id"] == rows[1].tool_calls[0]["id"]
    assert result == {"ok": True, "result": sum(calls[0])}
    assert (out.final_text or "").strip()
    assert out.usage.requests == 2 and out.usage.total_tokens > 0
    assert deltas, "on_event saw no deltas"

    # The persisted transcript of that pass reloads cleanly and equals it.
    loaded = load_session(tmp_path / f"{out.id}.jsonl")
    assert loaded.closed and loaded.stop_reason == "final_answer"
    assert loaded.session.chunk_table == out.chunk_table
    assert loaded.session.usage == out.usage
    assert loaded.agent.chunk_table == AGENT.chunk_table
    assert loaded.session.to_messages() == out.to_messages()


async def test_extra_body_reaches_the_server(
    local_server: LocalModelServer, closing_clients: None
) -> None:
    """A huge bias on `<end_of_turn>` ends the reply at once; without extra_body it runs on."""
    user = _messages({"role": "user", "content": "Tell me a story about a lighthouse."})
    forced = local_server.provider(extra_body={"logit_bias": {"106": 100}}, max_tokens=16)
    ended = await _ask(forced, user, stream=False, tools=False)
    assert ended.choices[0].finish_reason == "stop"
    assert ended.usage is not None and ended.usage.completion_tokens <= 1

    plain = local_server.provider(extra_body=None, max_tokens=16)
    ran_on = await _ask(plain, user, stream=False, tools=False)
    assert ran_on.choices[0].finish_reason == "length"
    assert ran_on.usage is not None and ran_on.usage.completion_tokens == 16


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_context_length_error(
    local_server: LocalModelServer, closing_clients: None, stream: bool
) -> None:
    too_long = "word " * (DEFAULT_CONTEXT_TOKENS + 500)
    with pytest.raises(ContextLengthError):
        await _ask(
            local_server.provider(), _messages({"role": "user", "content": too_long}), stream=stream
        )


def test_context_length_error_surfaces_from_a_pass(local_server: LocalModelServer) -> None:
    too_long = "word " * (DEFAULT_CONTEXT_TOKENS + 500)
    out = run_session_loop(
        Session.from_user_message(too_long), AGENT, agent_provider=local_server.provider()
    )
    with pytest.raises(ContextLengthError):
        out.synchronize()


async def test_dropped_keepalive_connections_never_fail_a_request(
    local_server: LocalModelServer, closing_clients: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The server closes the socket just after each streamed reply; reuse must be retried."""
    provider = local_server.provider(max_tokens=4)
    user = _messages({"role": "user", "content": "Say hello."})
    with caplog.at_level(logging.INFO, logger="treadle.llm"):
        for _ in range(20):
            reply = await _ask(provider, user, stream=True, tools=False)
            assert reply.choices[0].finish_reason in ("stop", "length")
    retries = [r for r in caplog.records if r.getMessage().startswith("retrying")]
    print(f"\n[e2e] 20 back-to-back streamed requests, {len(retries)} retried after a drop")


def test_back_to_back_streamed_passes(local_server: LocalModelServer) -> None:
    for _ in range(2):
        out = run_session_loop(
            Session.from_user_message(PROMPT),
            AGENT,
            agent_provider=local_server.provider(stream=True),
            tools=[_add_tool([])],
            max_tool_rounds=4,
        )
        assert out.stop_reason == "final_answer"


def test_run_demo_drives_the_real_model() -> None:
    out = io.StringIO()
    assert run_demo(out=out) == 0
    text = out.getvalue()
    assert "Transcript:" in text and "tool_result" in text and "Server stopped." in text
