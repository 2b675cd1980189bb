"""SSE decoding and stream accumulation: any chunking accumulates to the non-streamed reply."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.errors import MalformedResponse
from treadle.llm import ChatCompletion, ChatCompletionChunk, SSEDecoder, StreamAccumulator
from treadle.llm.chunk_parse import parse_event
from treadle.llm.sse import DONE
from treadle.testing.fake_replies import Reply, ToolCallSpec, render_completion, render_stream

texts = st.text(min_size=0, max_size=60)


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    content = draw(st.none() | texts)
    calls = tuple(
        ToolCallSpec(name, args, id=f"call_{i}")
        for i, (name, args) in enumerate(
            draw(st.lists(st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), texts),
                          max_size=3))
        )
    )  # fmt: skip
    reasoning = draw(st.none() | st.text(min_size=1, max_size=40))
    return Reply(
        content=content,
        tool_calls=calls,
        message_extra={"reasoning_content": reasoning} if reasoning else None,
        chunk_chars=draw(st.integers(1, 20)),
    )


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for p in points:
        pieces.append(data[start:p])
        start = p
    pieces.append(data[start:])
    return pieces


@settings(max_examples=150, deadline=None)
@given(reply=replies(), cuts=st.lists(st.integers(0, 10_000), max_size=30), crlf=st.booleans())
def test_any_chunking_accumulates_to_the_whole_reply(
    reply: Reply, cuts: list[int], crlf: bool
) -> None:
    meta = {"model": "m", "completion_id": "chatcmpl-1", "created": 7, "request_bytes": 100}
    whole = ChatCompletion.model_validate_json(render_completion(reply, **meta))
    stream = b"".join(render_stream(reply, include_usage=True, **meta))
    stream = b": keep-alive\n\n" + stream
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    decoder, acc, folded, done = SSEDecoder(), StreamAccumulator(), StreamAccumulator(), False
    for piece in _split(stream, cuts):
        for data in decoder.feed(piece):
            if data == DONE:
                done = True
                continue
            acc.add(ChatCompletionChunk.model_validate_json(data))
            folded.add_event(parse_event(data, None, None)[0])  # the turn's form: dicts
    assert done and not decoder.flush()
    result = acc.result()
    assert folded.result() == result
    assert result.message.model_dump(exclude_none=True) == whole.message.model_dump(
        exclude_none=True
    )
    assert result.finish_reason == whole.finish_reason
    assert result.usage == whole.usage
    assert (result.id, result.model, result.created) == (whole.id, whole.model, whole.created)


def test_decoder_handles_multiline_data_comments_and_unterminated_tail() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b": comment\nevent: x\ndata: a\ndata: b\n\nda") == [b"a\nb"]
    assert decoder.feed(b"ta: {}") == []
    assert decoder.flush() == [b"{}"]


def test_accumulator_replaces_identity_fields_and_keeps_unknown_ones() -> None:
    acc = StreamAccumulator()
    for delta in (
        {"role": "assistant", "content": "He"},
        {"role": "assistant", "content": "llo", "reasoning_content": "think"},
        {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
    ):
        acc.add(ChatCompletionChunk.model_validate({"choices": [{"index": 0, "delta": delta}]}))
    acc.add(ChatCompletionChunk.model_validate({"choices": [{"delta": {}, "finish_reason": "x"}]}))
    message = acc.result().message
    assert message.role == "assistant" and message.content == "Hello"
    assert message.model_extra == {"reasoning_content": "think"}
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        ("a", "f", '{"x":1}'),
        ("b", "g", "{}"),
    ]


@pytest.mark.parametrize("typed", [True, False])
def test_an_empty_role_never_wipes_a_known_role(typed: bool) -> None:
    # Some providers repeat `"role": ""` in later deltas; the first event's role must stay.
    acc = StreamAccumulator()
    for delta in ({"role": "assistant", "content": "a"}, {"role": "", "content": "b"}):
        event = {"choices": [{"index": 0, "delta": delta}]}
        if typed:
            acc.add(ChatCompletionChunk.model_validate(event))
        else:
            acc.add_event(event)
    message = acc.result().message
    assert (message.role, message.content) == ("assistant", "ab")


@pytest.mark.parametrize(
    "payload",
    [
        b'{"id":"c","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}',
        b'{"choices":[{"index":"0","delta":{"tool_calls":[{"index":"1","function":{}}]}}]}',
        b'{"created":1.0,"choices":[],"usage":{"prompt_tokens":1,"total_tokens":"3"}}',
        b'{"choices":[{"delta":{"content":[{"type":"text","text":"a"}]},"finish_reason":"stop"}]}',
        b'{"choices":[{"delta":{"role":"assistant"}}],"x_extra":{"kept":true}}',
        b'{"choices":[{"index":true,"delta":{}}]}',
    ],
)
def test_parse_event_gives_what_the_schema_gives(payload: bytes) -> None:
    # Exact events skip the validator, others are coerced by it: the result is the same.
    from treadle.llm.chunk_parse import _EVENT

    event, total, finished = parse_event(payload, None, None)
    assert event == _EVENT.validate_json(payload)
    usage = event.get("usage")
    assert total == (usage.get("total_tokens", 0) if usage is not None else None)
    assert finished == any(c.get("finish_reason") for c in event.get("choices", ()))


@pytest.mark.parametrize(
    "payload",
    [
        b'{"choices":null}',
        b'{"choices":[{"delta":null}]}',
        b'{"choices":[{"delta":{"content":5}}]}',
        b'{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":{"a":1}}}]}}]}',
        b'{"id":null,"choices":[]}',
        b"[1, 2]",
        b"not json",
    ],
)
def test_parse_event_rejects_what_the_schema_rejects(payload: bytes) -> None:
    with pytest.raises(MalformedResponse):
        parse_event(payload, None, None)


def _lines_one_by_one(stream: bytes) -> list[bytes]:
    """The decoder's rule written plainly (the reference): lines end at LF, one CR before it
    is dropped, `data:` loses one leading space, a blank line ends the event."""
    out: list[bytes] = []
    data: list[bytes] = []
    for line in stream.split(b"\n")[:-1]:
        line = line[:-1] if line.endswith(b"\r") else line
        if not line:
            if data:
                out.append(b"\n".join(data))
            data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return out


def test_decoder_reads_cr_lf_the_same_at_every_split() -> None:
    # A CR ending a read whose LF comes in the next, CRs inside a line and doubled before the
    # LF, bare LFs among CRLFs, `data:` with no, one and two spaces.
    stream = (
        b"data: a\r\n\r\ndata:b\rc\r\n\r\ndata:  d\r\r\n\n: x\r\ndata: e\ndata: f\r\n\r\n"
        b'data: {"k": 1}\r\n\r\n'
    )
    want = _lines_one_by_one(stream)
    assert want == [b"a", b"b\rc", b" d\r", b"e\nf", b'{"k": 1}']
    for cut in range(len(stream) + 1):
        for second in (cut, min(cut + 1, len(stream)), min(cut + 7, len(stream))):
            decoder = SSEDecoder()
            got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:second])
            got += decoder.feed(stream[second:]) + decoder.flush()
            assert got == want, (cut, second)
