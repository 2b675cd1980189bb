"""Provider reply shapes beyond plain OpenAI, written from the providers' public documentation.

Each shape is served byte for byte by the fake server and run through a real pass: streamed
tool calls without `index`, content given as a list of parts (Mistral's Magistral), reasoning
fields that must be joined while their `format`/`channel` stay single values (OpenRouter's
`reasoning_details`, Groq's `channel`), usage only under `x_groq.usage`, and errors reported
inside a 200 reply (an SSE `event: error`, a chunk carrying `error`, a whole `{"error": ...}`
body), retried when the status they name is retryable. Each test runs twice: without callbacks
(the turn folds validated event dicts) and with `on_event` (typed chunks, handed to the callback).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest

from treadle import Session
from treadle.errors import MalformedResponse, ProviderError, RateLimitError
from treadle.llm import (
    ChatCompletionChunk,
    CompletionRequest,
    HttpExecutor,
    Provider,
    request_turn,
)
from treadle.loop import run_session_loop
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply
from treadle.tools import ToolSet

AGENT = Session.from_agent_prompt("Answer briefly.")


_EVENTS: list[Any] | None = None  # set by the `server` fixture: None runs without callbacks


@pytest.fixture(params=["folded", "on_event"])
def server(request: pytest.FixtureRequest) -> Iterator[FakeOpenAIServer]:
    global _EVENTS
    _EVENTS = [] if request.param == "on_event" else None
    try:
        with FakeOpenAIServer() as srv:
            yield srv
    finally:
        _EVENTS = None


def _sse(*events: dict[str, Any] | str, done: bool = True) -> Reply:
    lines = []
    for event in events:
        if isinstance(event, str):
            lines.append(event)  # a raw block, e.g. "event: error\ndata: {...}"
        else:
            lines.append("data: " + json.dumps(event))
    if done:
        lines.append("data: [DONE]")
    body = ("\n\n".join(lines) + "\n\n").encode()
    return Reply.raw(body, content_type="text/event-stream")


def _chunk(delta: dict[str, Any], finish: str | None = None, **top: Any) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **top,
    }


def _whole(message: dict[str, Any], **top: Any) -> Reply:
    body = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        **top,
    }
    return Reply.raw(json.dumps(body).encode())


def _run(server: FakeOpenAIServer, *, stream: bool, retries: int = 0) -> Session:
    provider = Provider(
        model="m",
        base_url=server.base_url,
        api_key="sk-test",
        stream=stream,
        max_retries=retries,
        retry_base_delay=0.0,
    )
    user = Session.from_user_message("Hello")
    events = _EVENTS
    return run_session_loop(
        user,
        AGENT,
        agent_provider=provider,
        max_tool_rounds=3,
        lazy=False,
        on_event=None if events is None else events.append,
    )


def test_streamed_tool_calls_without_index_stay_separate_calls(server: FakeOpenAIServer) -> None:
    def call(cid: str | None, name: str | None, args: str) -> dict[str, Any]:
        piece: dict[str, Any] = {"function": {"arguments": args}}
        if cid:
            piece.update(id=cid, type="function")
            piece["function"]["name"] = name
        return {"tool_calls": [piece]}

    server.enqueue(
        _sse(
            _chunk({"role": "assistant", "content": None}),
            _chunk(call("call_a", "first", '{"x":')),
            _chunk(call(None, None, " 1}")),
            _chunk(call("call_b", "second", "{}")),
            _chunk({}, "tool_calls"),
        ),
        Reply.text("done"),
    )
    out = _run(server, stream=True)
    calls = out.rows[1].calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("call_a", "first", '{"x": 1}'),
        ("call_b", "second", "{}"),
    ]
    assert [r.payload["tool_call_id"] for r in out.rows[2:4]] == ["call_a", "call_b"]


def test_every_call_numbered_zero_is_still_two_calls(server: FakeOpenAIServer) -> None:
    fn = {"name": "lookup", "arguments": "{}"}
    server.enqueue(
        _sse(
            _chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function", "function": fn}]}),
            _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": fn}]}),
            _chunk({}, "tool_calls"),
        ),
        Reply.text("done"),
    )
    out = _run(server, stream=True)
    assert [c.id for c in out.rows[1].calls] == ["c0", "c1"]


MAGISTRAL_PARTS = [
    {"type": "thinking", "thinking": [{"type": "text", "text": "Two and two."}]},
    {"type": "text", "text": "It is 4."},
]


def test_content_parts_whole_reply(server: FakeOpenAIServer) -> None:
    server.enqueue(_whole({"role": "assistant", "content": MAGISTRAL_PARTS}))
    out = _run(server, stream=False)
    assert out.rows[1].payload["content"] == MAGISTRAL_PARTS
    assert out.final_text == "It is 4."


def test_content_parts_streamed_like_magistral(server: FakeOpenAIServer) -> None:
    def thinking(text: str) -> dict[str, Any]:
        return {"content": [{"type": "thinking", "thinking": [{"type": "text", "text": text}]}]}

    server.enqueue(
        _sse(
            _chunk({"role": "assistant", "content": ""}),
            _chunk(thinking("Two and")),
            _chunk(thinking(" two.")),
            _chunk({"content": "It is"}),
            _chunk({"content": " 4."}, "stop"),
        )
    )
    out = _run(server, stream=True)
    assert out.rows[1].payload["content"] == MAGISTRAL_PARTS  # the same row as the whole reply
    assert out.final_text == "It is 4."
    # sent back on the next turn exactly as the provider gave it
    again = out.add_user_message("thanks")
    server.enqueue(Reply.text("ok"))
    _run_on(server, again)
    sent = server.requests[-1].body["messages"]
    assert sent[2]["content"] == MAGISTRAL_PARTS


def _run_on(server: FakeOpenAIServer, user: Session) -> Session:
    provider = Provider(model="m", base_url=server.base_url, api_key="sk-test", max_retries=0)
    return run_session_loop(user, AGENT, agent_provider=provider, lazy=False)


def test_reasoning_is_joined_and_its_enums_are_kept_once(server: FakeOpenAIServer) -> None:
    def detail(text: str, **more: Any) -> dict[str, Any]:
        item = {"type": "reasoning.text", "text": text, "format": "anthropic-claude-v1"}
        return {"reasoning": text, "reasoning_details": [{**item, "index": 0, **more}]}

    server.enqueue(
        _sse(
            _chunk({"role": "assistant", "content": ""}),
            _chunk({**detail("Think", signature=""), "channel": "analysis"}),
            _chunk({**detail(" hard."), "channel": "analysis"}),
            _chunk({"reasoning_details": [{"type": "reasoning.text", "signature": "sig==",
                                           "format": "anthropic-claude-v1", "index": 0}]}),
            _chunk({"content": "Done."}, "stop"),
        )
    )  # fmt: skip
    payload = _run(server, stream=True).rows[1].payload
    assert payload["reasoning"] == "Think hard."
    assert payload["channel"] == "analysis"
    assert payload["reasoning_details"] == [
        {
            "type": "reasoning.text",
            "text": "Think hard.",
            "format": "anthropic-claude-v1",
            "index": 0,
            "signature": "sig==",
        }
    ]


def test_usage_under_x_groq_is_read(server: FakeOpenAIServer) -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 7, "total_tokens": 57, "queue_time": 0.1}
    server.enqueue(
        _sse(
            _chunk({"role": "assistant", "content": "Hi"}, x_groq={"id": "req_1"}),
            _chunk({}, "stop", x_groq={"id": "req_1", "usage": usage}),
        )
    )
    out = _run(server, stream=True)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (50, 7)
    assert out.usage.total_tokens == 57


def test_sse_error_event_raises_the_provider_message(server: FakeOpenAIServer) -> None:
    error = {"error": {"message": "tool call validation failed", "type": "invalid_request_error",
                       "code": "tool_use_failed", "status_code": 400}}  # fmt: skip
    server.enqueue(
        _sse(
            _chunk({"role": "assistant", "reasoning": "hm"}),
            "event: error\ndata: " + json.dumps(error),
            done=False,
        )
    )
    with pytest.raises(ProviderError, match="tool call validation failed") as caught:
        _run(server, stream=True, retries=2)
    assert caught.value.status_code == 400
    assert server.request_count == 1  # a 400 is not retried


def test_error_chunk_with_a_retryable_status_is_retried(server: FakeOpenAIServer) -> None:
    failing = _chunk({"content": ""}, error={"code": 503, "message": "upstream overloaded"})
    server.enqueue(_sse(_chunk({"content": "Par"}), failing), Reply.text("Paris"))
    out = _run(server, stream=True, retries=1)
    assert out.final_text == "Paris"
    assert server.request_count == 2


def test_error_chunk_out_of_retries_is_typed(server: FakeOpenAIServer) -> None:
    failing = _chunk({"content": ""}, error={"code": 429, "message": "slow down please"})
    server.enqueue(_sse(failing), _sse(failing))
    with pytest.raises(RateLimitError, match="slow down please"):
        _run(server, stream=True, retries=1)
    assert server.request_count == 2


def test_whole_error_body_with_status_200_is_typed_and_retried(server: FakeOpenAIServer) -> None:
    body = json.dumps({"error": {"code": 429, "message": "Provider returned error"}}).encode()
    server.enqueue(Reply.raw(body), Reply.text("ok"))
    assert _run(server, stream=False, retries=1).final_text == "ok"
    server.enqueue(Reply.raw(body))
    with pytest.raises(RateLimitError, match="Provider returned error"):
        _run(server, stream=False, retries=0)


def test_an_sse_error_event_with_bare_data_is_still_an_error(server: FakeOpenAIServer) -> None:
    bare = "event: error\ndata: " + json.dumps({"message": "overloaded", "code": 503})
    server.enqueue(
        _sse(_chunk({"content": "Par"}), bare, done=False),
        _sse(_chunk({"role": "assistant"}), "event: error\ndata: upstream went away", done=False),
    )
    with pytest.raises(ProviderError, match="upstream went away"):
        _run(server, stream=True, retries=1)  # the first is retried (503), the second is not
    assert server.request_count == 2


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"choices": [{"index": "first", "delta": {}}]}, "does not match the schema"),
        ({"choices": [{"delta": {"tool_calls": [{"function": "f"}]}}]}, "does not match"),
        ({"choices": "none"}, "does not match the schema"),
        ("data: {not json", "is not JSON"),
    ],
)
def test_a_malformed_event_mid_stream_is_a_clear_error(
    server: FakeOpenAIServer, bad: dict[str, Any] | str, said: str
) -> None:
    server.enqueue(_sse(_chunk({"role": "assistant", "content": "Hi"}), bad, _chunk({}, "stop")))
    with pytest.raises(MalformedResponse, match=said):
        _run(server, stream=True)


def test_callbacks_see_the_index_a_call_without_one_belongs_to(server: FakeOpenAIServer) -> None:
    if _EVENTS is None:
        pytest.skip("checks what on_event receives")
    first = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{"}}
    server.enqueue(
        _sse(
            _chunk({"tool_calls": [first]}),
            _chunk({"tool_calls": [{"function": {"arguments": "}"}}]}),
            _chunk({"tool_calls": [{"id": "call_b", "function": {"name": "g", "arguments": ""}}]}),
            _chunk({}, "tool_calls"),
        ),
        Reply.text("done"),
    )
    _run(server, stream=True)
    indices = [
        call.index
        for event in _EVENTS
        for choice in getattr(event, "choices", ())
        for call in choice.delta.tool_calls or ()
    ]
    assert indices == [0, 0, 1]


def test_an_http_executor_subclass_keeps_its_own_astream(server: FakeOpenAIServer) -> None:
    if _EVENTS is not None:
        pytest.skip("a custom executor takes no on_event")
    seen: list[ChatCompletionChunk] = []

    class Watching(HttpExecutor):
        async def astream(self, request: CompletionRequest) -> AsyncGenerator[ChatCompletionChunk]:
            async for chunk in super().astream(request):
                seen.append(chunk)
                yield chunk

    server.enqueue(_sse(_chunk({"role": "assistant", "content": "Hi"}), _chunk({}, "stop")))
    provider = Provider(model="m", base_url=server.base_url, api_key="sk-test", stream=True)
    user = Session.from_user_message("Hello")
    request = CompletionRequest(
        "s1", provider, AGENT.rows, user.rows, ToolSet.build([]), stream=True
    )
    turn = asyncio.run(request_turn(Watching(), request))
    assert turn.payload["content"] == "Hi"
    assert len(seen) == 2
