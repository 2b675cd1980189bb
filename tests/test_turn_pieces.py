"""A pass's events read a streamed turn's text and tool-call pieces from the folded event dicts
(`request_turn(on_pieces=...)`) instead of a typed chunk per event: the same pieces, in the same
order, as the typed deltas give, on every stream shape (role-first, index-less and renumbered
tool calls, content parts, several events per read, the recorded provider streams)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from recorded_replies import replies_dir
from treadle import Session
from treadle.llm import Provider
from treadle.llm.deltas import ToolCallPiece, TurnDelta
from treadle.llm.request import CompletionRequest
from treadle.llm.turn import HttpExecutor, request_turn
from treadle.loop import stream_session_loop
from treadle.loop.events import TextDelta, ToolCallDelta
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply
from treadle.tools import ToolSet

AGENT = Session.from_agent_prompt("Answer.")


RECORDED = replies_dir()


def _sse(*events: dict[str, Any]) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [choice]}  # fmt: skip


MADE = {
    "role-first text": _sse(
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({}, "stop"),
    ),
    "index-less calls": _sse(
        _chunk({"role": "assistant"}),
        _chunk({"tool_calls": [{"id": "a", "type": "function", "function": {"name": "f"}}]}),
        _chunk({"tool_calls": [{"function": {"arguments": '{"x":'}}]}),
        _chunk({"tool_calls": [{"function": {"arguments": "1}"}}]}),
        _chunk({"tool_calls": [{"id": "b", "function": {"name": "g", "arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
    ),
    "one index, two ids": _sse(
        _chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f"}}]}),
        _chunk({"tool_calls": [{"index": 0, "id": "b", "function": {"name": "g"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
    ),
    "content parts": _sse(
        _chunk({"content": [{"type": "thinking", "thinking": "hm"}]}),
        _chunk({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        _chunk({"content": "c"}, "stop"),
    ),
}


def _streams() -> list[tuple[str, bytes]]:
    out = list(MADE.items())
    if RECORDED is not None:  # the recordings beside the checkout, when they are there
        out += [(p.name, p.read_bytes()) for p in sorted(RECORDED.glob("*.sse"))]
    return out


def _plain(delta: TurnDelta) -> tuple[str | None, tuple[ToolCallPiece, ...]]:
    return delta.text, delta.tool_calls


@pytest.mark.parametrize(("name", "body"), _streams(), ids=[n for n, _ in _streams()])
async def test_pieces_are_what_the_typed_deltas_give(name: str, body: bytes) -> None:
    reply = Reply(body=body, content_type="text/event-stream")
    with FakeOpenAIServer(replies=[reply, reply]) as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="sk", max_retries=0)
        user = Session.from_user_message("hi")
        request = CompletionRequest(
            "s", provider, AGENT.rows, user.rows, ToolSet.build([]), stream=True
        )
        typed: list[TurnDelta] = []
        pieces: list[tuple[str | None, tuple[ToolCallPiece, ...]]] = []
        outcomes = []
        for kwargs in ({"on_delta": typed.append}, {"on_pieces": lambda *p: pieces.append(p)}):
            try:
                turn = await request_turn(HttpExecutor(), request, **kwargs)  # type: ignore[arg-type]
            except Exception as error:  # a recorded in-band error: the same either way
                outcomes.append(repr(error))
            else:
                outcomes.append(turn.payload)
    assert outcomes[0] == outcomes[1]
    assert pieces == [_plain(d) for d in typed]


async def test_a_pass_emits_the_same_events_with_and_without_on_event() -> None:
    # With `on_event` the pass keeps the typed chunks (its callback receives them); without, its
    # events come from the dicts: the same TextDelta and ToolCallDelta events either way.
    body = MADE["index-less calls"]
    seen = []
    for with_callback in (True, False):
        replies = [Reply(body=body, content_type="text/event-stream"), Reply.text("done")]
        with FakeOpenAIServer(replies=replies) as server:
            provider = Provider(model="m", base_url=server.base_url, api_key="sk", stream=True)
            options: dict[str, Any] = {"on_event": lambda _: None} if with_callback else {}
            user = Session.from_user_message("hi")
            loop = stream_session_loop(user, AGENT, agent_provider=provider, **options)
            events = [e async for e in loop]
        seen.append(
            [
                (e.text,) if isinstance(e, TextDelta)
                else (e.index, e.call_id, e.name, e.arguments)
                for e in events
                if isinstance(e, (TextDelta, ToolCallDelta))
            ]
        )  # fmt: skip
    assert seen[0] == seen[1]
    assert seen[0][:2] == [(0, "a", "f", ""), (0, None, None, '{"x":')]
    assert (1, "b", "g", "{}") in seen[0]
