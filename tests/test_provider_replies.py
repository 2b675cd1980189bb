"""Every recorded reply of a real provider comes through a pass over loopback HTTP.

The recordings live outside the project (`../shared/provider-replies/`, or the folder named by
`TREADLE_PROVIDER_REPLIES`); this module skips when they are absent. Each recording is served byte
for byte by the fake server, in the form it was recorded (whole JSON or SSE), and the pass must
give: the text exactly; tool calls with their ids, names and arguments; the usage from wherever
the provider put it; unknown message fields kept with their recorded values (text deltas joined,
identity fields not repeated); an error as a typed `ProviderError` carrying the provider's
message. The expected values are computed here from the recording, independently of the client.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recorded_replies import replies_dir
from treadle import Session
from treadle.errors import MalformedResponse, ProviderError
from treadle.llm import Provider, SSEDecoder, StreamAccumulator
from treadle.llm.chunk_parse import parse_chunk, parse_event
from treadle.llm.sse import DONE
from treadle.loop import run_session_loop
from treadle.session.rows import text_of_content
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply

REPLIES = replies_dir()


def _cases() -> list[tuple[str, Path, int, str]]:
    """(name, file, status, kind) of every recording, follow-up replies (`.final`) included."""
    if REPLIES is None:
        return []
    out = []
    for meta_path in sorted(REPLIES.glob("*.meta.json")):
        meta = json.loads(meta_path.read_text())
        out.append((meta["case"], REPLIES / meta["file"], int(meta["status"]), meta["kind"]))
        final = meta.get("final")
        if final:
            name = meta["case"] + ".final"
            out.append((name, REPLIES / final["file"], int(final["status"]), final["kind"]))
    return out


CASES = _cases()
pytestmark = pytest.mark.skipif(REPLIES is None, reason="no recorded provider replies here")
AGENT = Session.from_agent_prompt("Answer briefly.")
TEXT_FIELDS = ("reasoning_content", "reasoning", "refusal")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv


def _events(body: bytes) -> list[dict[str, Any]]:
    """The JSON `data:` payloads of an SSE body (a test-side reference decoder)."""
    out = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")
        )
        if data and data != "[DONE]":
            out.append(json.loads(data))
    return out


def _expected_from_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the first choice's message is, built the plain way: join text, keep the last value."""
    text, thinking = "", ""
    joined: dict[str, str] = {}
    last: dict[str, Any] = {}
    calls: dict[int, dict[str, str]] = {}
    usage: dict[str, Any] | None = None
    error: Any = None
    for event in events:
        error = error or event.get("error")
        if event.get("usage"):
            usage = event["usage"]
        elif usage is None and isinstance(event.get("x_groq"), dict):
            usage = event["x_groq"].get("usage") or usage
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if isinstance(content, str):
                text += content
            elif isinstance(content, list):
                for part in content:
                    if part.get("type") == "text":
                        text += part["text"]
                    elif part.get("type") == "thinking":
                        thinking += "".join(p.get("text", "") for p in part["thinking"])
            for call in delta.get("tool_calls") or ():
                entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                fn = call.get("function") or {}
                entry["name"] = fn.get("name") or entry["name"]
                entry["arguments"] += fn.get("arguments") or ""
            for key, value in delta.items():
                if key in TEXT_FIELDS and isinstance(value, str):
                    joined[key] = joined.get(key, "") + value
                elif key not in ("content", "tool_calls", "role") and value not in (None, ""):
                    last[key] = value
    return {
        "text": text,
        "thinking": thinking,
        "joined": joined,
        "last": last,
        "calls": [calls[i] for i in sorted(calls)],
        "usage": usage,
        "error": error,
    }


def _expected_from_whole(body: dict[str, Any]) -> dict[str, Any]:
    message = body["choices"][0]["message"]
    calls = [
        {
            "id": c.get("id") or f"call_{i}",
            "name": c["function"]["name"],
            "arguments": c["function"]["arguments"],
        }
        for i, c in enumerate(message.get("tool_calls") or ())
    ]
    usage = body.get("usage") or (body.get("x_groq") or {}).get("usage")
    return {"message": message, "calls": calls, "usage": usage, "error": body.get("error")}


def _run(server: FakeOpenAIServer, body: bytes, status: int, kind: str) -> Session:
    content_type = "text/event-stream" if kind == "sse" else "application/json"
    server.enqueue(
        Reply.raw(body, status=status, content_type=content_type),
        Reply.text("done").with_usage(0, 0),  # answers the tool round of a tool-calling reply
    )
    provider = Provider(
        model="recorded",
        base_url=server.base_url,
        api_key="sk-test",
        stream=kind == "sse",
        max_retries=0,
    )
    user = Session.from_user_message("Hello")
    return run_session_loop(user, AGENT, agent_provider=provider, max_tool_rounds=2, lazy=False)


def _check_calls(row_calls: list[dict[str, Any]], expected: list[dict[str, str]]) -> None:
    got = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in row_calls
    ]
    assert got == expected
    for call in row_calls:
        json.loads(call["function"]["arguments"] or "{}")  # whole JSON, not pieces glued twice


def _check_usage(out: Session, usage: dict[str, Any] | None) -> None:
    if not usage:
        assert out.usage.requests >= 1
        return
    assert out.usage.prompt_tokens == usage.get("prompt_tokens", 0)
    assert out.usage.completion_tokens == usage.get("completion_tokens", 0)
    total = usage.get("total_tokens") or usage["prompt_tokens"] + usage["completion_tokens"]
    assert out.usage.total_tokens == total


def _provider_message(error: Any) -> str:
    if isinstance(error, dict):
        inner = error.get("error", error)
        if isinstance(inner, dict):
            return str(inner.get("message") or "")
        return str(inner)
    return str(error)


@pytest.mark.parametrize("name, path, status, kind", CASES, ids=[c[0] for c in CASES])
def test_recorded_reply_comes_through_a_pass(
    server: FakeOpenAIServer, name: str, path: Path, status: int, kind: str
) -> None:
    body = path.read_bytes()
    server.clear_faults()
    if kind == "sse":
        expected = _expected_from_stream(_events(body))
    else:
        parsed = json.loads(body)
        expected = (
            _expected_from_whole(parsed)
            if status == 200 and "choices" in parsed
            else {"error": parsed}
        )
    if status != 200 or expected["error"]:
        server._queue.clear()
        with pytest.raises(ProviderError) as caught:
            _run(server, body, status, kind)
        said = _provider_message(expected["error"])
        assert said[:200] in str(caught.value), (said, str(caught.value))
        if status != 200:
            assert caught.value.status_code == status
        server._queue.clear()
        return
    out = _run(server, body, status, kind)
    server._queue.clear()
    row = out.rows[1]
    assert row.kind == "assistant"
    payload = row.payload
    if kind == "sse":
        assert (text_of_content(payload["content"]) or "") == expected["text"]
        if expected["thinking"]:
            parts = [p for p in payload["content"] if p.get("type") == "thinking"]
            assert "".join(t["text"] for p in parts for t in p["thinking"]) == expected["thinking"]
        for key, value in expected["joined"].items():
            assert payload[key] == value, key
        for key, value in expected["last"].items():
            assert key in payload, key
            if isinstance(value, str):
                assert payload[key] == value, key  # an enum kept once, not once per chunk
        for detail in payload.get("reasoning_details") or ():
            assert detail.get("format") in (None, "anthropic-claude-v1", "unknown"), detail
    else:
        message = expected["message"]
        assert payload["content"] == message.get("content")
        for key, value in message.items():
            if key not in ("role", "content", "tool_calls") and value is not None:
                assert payload[key] == value, key
    _check_calls(row.tool_calls, expected["calls"])
    _check_usage(out, expected["usage"])
    if expected["calls"]:
        assert out.rows[2].kind == "tool_result"
        assert out.rows[2].payload["tool_call_id"] == expected["calls"][0]["id"]
    assert out.stop_reason == "final_answer"


def test_every_recording_is_covered() -> None:
    if REPLIES is None:
        pytest.skip("no recorded provider replies here")
    recorded = {p.name for p in REPLIES.iterdir() if p.suffix in (".json", ".sse")}
    recorded = {n for n in recorded if not n.endswith(".meta.json")}
    assert {c[1].name for c in CASES} == recorded


STREAMED = [c for c in CASES if c[3] == "sse" and c[2] == 200]


@pytest.mark.parametrize("name, path, status, kind", STREAMED, ids=[c[0] for c in STREAMED])
def test_a_recording_folds_the_same_as_dicts_and_as_chunks(
    name: str, path: Path, status: int, kind: str
) -> None:
    """The turn's dict fold (no callbacks) and the typed chunks' fold give the same completion."""
    decoder = SSEDecoder()
    events = [d for d in decoder.feed(path.read_bytes()) + decoder.flush() if d != DONE]
    typed, folded = StreamAccumulator(), StreamAccumulator()
    indices: tuple[list[object], list[object]] = ([], [])
    for data in events:
        try:
            chunk, _, _ = parse_chunk(data, None, None)
        except ProviderError as err:  # an error event: both forms must report the same
            with pytest.raises(type(err), match=re.escape(err.message[:80])):
                parse_event(data, None, None)
            continue
        event, _, _ = parse_event(data, None, None)
        typed.add(chunk)
        folded.add_event(event)
        for choice in chunk.choices:
            indices[0].extend(c.index for c in choice.delta.tool_calls or ())
        for got in event.get("choices", ()):
            indices[1].extend(c["index"] for c in got.get("delta", {}).get("tool_calls") or ())
    assert indices[0] == indices[1]
    try:
        expected = typed.result()
    except MalformedResponse:  # no choice streamed (an error reply)
        with pytest.raises(MalformedResponse):
            folded.result()
        return
    assert folded.result() == expected


WHOLE_OK = [c for c in CASES if c[3] == "json" and c[2] == 200]


@pytest.mark.parametrize("name, path, status, kind", WHOLE_OK, ids=[c[0] for c in WHOLE_OK])
def test_a_whole_recording_streamed_gives_the_same_row(
    server: FakeOpenAIServer, name: str, path: Path, status: int, kind: str
) -> None:
    """The same reply sent as one SSE chunk makes the same assistant row as the whole body."""
    body = json.loads(path.read_bytes())
    if "choices" not in body:
        pytest.skip("not a completion")
    choice = body["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    top = {k: v for k, v in body.items() if k not in ("choices", "object")}
    chunk = {
        **top,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}],
    }
    sse = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
    server._queue.clear()
    whole = _run(server, path.read_bytes(), 200, "json")
    server._queue.clear()  # the follow-up reply is left when the recording calls no tool
    streamed = _run(server, sse, 200, "sse")
    server._queue.clear()
    expected = dict(whole.rows[1].payload)
    if expected.get("tool_calls"):  # in a stream, `index` only says which call a piece extends
        expected["tool_calls"] = [
            {k: v for k, v in c.items() if k != "index"} for c in expected["tool_calls"]
        ]
    assert streamed.rows[1].payload == expected
    assert streamed.usage == whole.usage
