"""A streamed reply costs work linear in its length, however it is cut (SSE decoding and the fold).

A hostile or merely long stream must not make the client copy what it already holds on every
read or event: a line arriving over many reads, and a text field growing piece by piece, were
each copied whole at every step (quadratic: a 16 MiB line over 64 KiB reads took 1.3 s, a
200,000-event reply 17 s of the event loop every pass shares). The copies are counted, not
timed: the pieces are `bytes` / `str` subclasses whose `__radd__` records how much a `+` with
them copied (`+` is how the text used to grow; joining a list of pieces calls no `__radd__`).
"""

from __future__ import annotations

from typing import Any

from treadle.llm.accumulate import StreamAccumulator
from treadle.llm.sse import SSEDecoder

COPIED = {"bytes": 0}


class CountedBytes(bytes):
    """A read whose concatenation onto what came before is counted."""

    def __radd__(self, other: bytes) -> bytes:
        COPIED["bytes"] += len(other) + len(self)
        return bytes(other) + bytes(self)


class CountedStr(str):
    """A text piece whose concatenation onto the text before it is counted."""

    def __radd__(self, other: str) -> str:
        COPIED["bytes"] += len(other) + len(self)
        return str(other) + str(self)


def setup_function() -> None:
    COPIED["bytes"] = 0


def test_a_line_over_many_reads_is_joined_once() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"text": "') == []
    pieces = 2_000
    for _ in range(pieces):
        assert decoder.feed(CountedBytes(b"x" * 100)) == []
    out = decoder.feed(CountedBytes(b'"}\n\n'))
    assert out == [b'{"text": "' + b"x" * 100 * pieces + b'"}']
    # Before: every read copied the tail it joined (about 200 MB for these 200 KB).
    assert COPIED["bytes"] <= 2 * 100 * pieces


def test_a_line_cut_anywhere_decodes_as_before() -> None:
    body = (
        b'data: {"a": 1}\r\n\r\n: comment\n\ndata: {"b":\ndata: 2}\n\nevent: error\ndata: boom\n\n'
    )
    whole = SSEDecoder().feed(body)
    for size in (1, 2, 3, 5, 7, 64):
        decoder = SSEDecoder()
        out: list[bytes] = []
        for start in range(0, len(body), size):
            out += decoder.feed(body[start : start + size])
        out += decoder.flush()
        assert out == whole, size


def test_an_unterminated_line_over_many_reads_is_flushed() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"data: ")
    for _ in range(10):
        decoder.feed(b"ab")
    assert decoder.flush() == [b"ab" * 10]


def _event(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }


def test_a_long_text_reply_is_folded_without_copying_what_came_before() -> None:
    acc = StreamAccumulator()
    acc.add_event(_event({"role": "assistant", "content": ""}))
    pieces = 3_000
    for _ in range(pieces):
        acc.add_event(_event({"content": CountedStr("abcd"), "reasoning_content": CountedStr("r")}))
    acc.add_event(_event({}, "stop"))
    plain = acc.plain_turn()
    assert plain is not None
    payload = plain[0]
    assert payload["content"] == "abcd" * pieces
    assert payload["reasoning_content"] == "r" * pieces
    assert type(payload["content"]) is str
    # Before: each piece copied the text before it (about 18 MB for these 15 KB).
    assert COPIED["bytes"] <= 2 * 5 * pieces
    assert acc.result().choices[0].message.content == "abcd" * pieces


def test_long_tool_call_arguments_are_folded_without_copying() -> None:
    acc = StreamAccumulator()
    first = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    acc.add_event(_event({"tool_calls": [first]}))
    pieces = 3_000
    for _ in range(pieces):
        acc.add_event(
            _event({"tool_calls": [{"index": 0, "function": {"arguments": CountedStr("[1]")}}]})
        )
    acc.add_event(_event({}, "tool_calls"))
    completion = acc.result()
    calls = completion.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.arguments == "[1]" * pieces
    assert COPIED["bytes"] <= 2 * 3 * pieces


def test_item_text_and_content_parts_fold_as_before() -> None:
    acc = StreamAccumulator()
    acc.add_event(_event({"content": "a"}))
    acc.add_event(_event({"content": "b"}))
    # Text streamed before a parts list becomes its leading text part (the joined text).
    acc.add_event(_event({"content": [{"type": "thinking", "thinking": "t1"}]}))
    acc.add_event(_event({"content": [{"type": "thinking", "thinking": "t2"}]}))
    acc.add_event(_event({"content": "c"}))
    acc.add_event(_event({"content": "d"}))
    details = [{"index": 0, "type": "reasoning.text", "text": "x"}]
    acc.add_event(_event({"reasoning_details": details}))
    acc.add_event(_event({"reasoning_details": [{"index": 0, "text": "y"}]}))
    acc.add_event(_event({"reasoning_details": [{"index": 0, "text": "z"}]}, "stop"))
    message = acc.result().choices[0].message
    assert message.content == [
        {"type": "text", "text": "ab"},
        {"type": "thinking", "thinking": "t1t2"},
        {"type": "text", "text": "cd"},
    ]
    extra = message.model_extra or {}
    assert extra["reasoning_details"] == [{"index": 0, "type": "reasoning.text", "text": "xyz"}]


def test_the_fold_goes_on_after_it_was_read() -> None:
    acc = StreamAccumulator()
    acc.add_event(_event({"role": "assistant", "content": "a"}))
    acc.add_event(_event({"content": "b"}))
    assert acc.result().choices[0].message.content == "ab"
    acc.add_event(_event({"content": "c"}))
    acc.add_event(_event({"content": "d"}, "stop"))
    assert acc.result().choices[0].message.content == "abcd"
    plain = acc.plain_turn()
    assert plain is not None and plain[0]["content"] == "abcd"


def test_a_text_field_replaced_by_another_type_is_replaced_whole() -> None:
    acc = StreamAccumulator()
    acc.add_event(_event({"content": "a", "refusal": "no"}))
    acc.add_event(_event({"refusal": " way"}))
    # A list where a text was: the provider's list replaces it (as before, after the join).
    acc.add_event(_event({"refusal": [{"index": 0, "text": "x"}]}, "stop"))
    message = acc.result().choices[0].message
    assert message.content == "a"
    assert message.refusal == [{"index": 0, "text": "x"}]
    plain = acc.plain_turn()
    assert plain is not None and plain[0] == {
        "content": "a",
        "refusal": [{"index": 0, "text": "x"}],
    }


def test_many_tool_calls_are_each_found_in_one_lookup() -> None:
    """A reply of many calls: each delta finds its call by index without scanning the others."""
    acc = StreamAccumulator()
    n = 2_000
    for i in range(n):
        call = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": "f"}}
        acc.add_event(_event({"tool_calls": [call]}))
    looked: list[int] = []
    for i in range(n):
        # An index that counts how often it is compared: a scan compares it with every call.
        acc.add_event(
            _event({"tool_calls": [{"index": _Index(i, looked), "function": {"arguments": "{}"}}]})
        )
    # A server numbering every call 0 with new ids: each becomes a new call after the highest.
    acc.add_event(
        _event(
            {"tool_calls": [{"index": 0, "id": "other", "function": {"name": "g"}}]}, "tool_calls"
        )
    )
    calls = acc.result().choices[0].message.tool_calls
    assert calls is not None and len(calls) == n + 1
    assert [c.function.arguments for c in calls[:n]] == ["{}"] * n
    assert calls[-1].id == "other" and calls[-1].function.name == "g"
    assert len(looked) <= 4 * n  # a scan: about n * n / 2 comparisons


class _Index(int):
    """An int that records each equality test made with it."""

    def __new__(cls, value: int, log: list[int]) -> _Index:
        made = super().__new__(cls, value)
        made.log = log  # type: ignore[attr-defined]
        return made

    def __eq__(self, other: object) -> bool:
        self.log.append(1)  # type: ignore[attr-defined]
        return int(self) == other

    __hash__ = int.__hash__


def test_a_line_in_tiny_reads_holds_about_a_byte_per_byte() -> None:
    """Reads of two bytes are not each kept as an object of their own while the line grows."""
    import tracemalloc

    decoder = SSEDecoder()
    decoder.feed(b"data: ")
    reads = 50_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(reads):
            decoder.feed(b"ab")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 4 * 2 * reads  # a list of 2-byte `bytes` held about 20 times that
    assert decoder.feed(b"\n\n") == [b"ab" * reads]


def test_negative_tool_call_indexes_are_renumbered_after_the_highest() -> None:
    """A call renumbered (same index, new id) goes after the highest index so far, even when
    every index is negative, and later pieces reach the calls they name."""
    acc = StreamAccumulator()
    acc.add_event(
        _event(
            {"tool_calls": [{"index": -3, "id": "a", "function": {"name": "fa", "arguments": "{"}}]}
        )
    )
    acc.add_event(
        _event(
            {"tool_calls": [{"index": -3, "id": "b", "function": {"name": "fb", "arguments": "{"}}]}
        )
    )
    acc.add_event(
        _event(
            {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "fc", "arguments": "{"}}]}
        )
    )
    acc.add_event(_event({"tool_calls": [{"index": 0, "function": {"arguments": "3}"}}]}))
    acc.add_event(
        _event({"tool_calls": [{"index": -2, "function": {"arguments": "2}"}}]}, "tool_calls")
    )
    calls = acc.result().choices[0].message.tool_calls
    assert calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("a", "fa", "{"),
        ("b", "fb", "{2}"),
        ("c", "fc", "{3}"),
    ]


def test_what_a_read_hands_out_and_the_events_folded_stay_as_they_were() -> None:
    """A completion read mid-stream is a snapshot, and the fold never changes a caller's event."""
    acc = StreamAccumulator()
    first = _event(
        {
            "role": "assistant",
            "content": "hi",
            "audio": {"id": "a1", "text": "x"},
            "reasoning_details": [{"index": 0, "type": "reasoning.text", "text": "a"}],
        }
    )
    acc.add_event(first)
    plain = acc.plain_turn()
    held = acc.result()
    for piece in ("b", "c"):
        acc.add_event(
            _event({"audio": {"text": piece}, "reasoning_details": [{"index": 0, "text": piece}]})
        )
    assert plain is not None and plain[0]["reasoning_details"][0]["text"] == "a"
    extra = held.choices[0].message.model_extra or {}
    assert extra["reasoning_details"][0]["text"] == "a"
    assert '"text":"a"' in held.model_dump_json()  # nothing unserialisable crept in
    assert first["choices"][0]["delta"]["audio"] == {"id": "a1", "text": "x"}
    final = acc.result().choices[0].message.model_extra or {}
    assert final["reasoning_details"][0]["text"] == "abc"
    assert final["audio"] == {"id": "a1", "text": "xbc"}


def test_many_indexed_items_are_each_found_in_one_lookup() -> None:
    """`reasoning_details` items, one event per item or all in one event, are found by index
    through a map once the list is long, not by a scan per item."""
    n = 2_000
    for one_event in (False, True):
        acc = StreamAccumulator()
        first = [{"index": i, "type": "reasoning.text", "text": "a"} for i in range(n)]
        if one_event:
            acc.add_event(_event({"reasoning_details": first}))
        else:
            for item in first:
                acc.add_event(_event({"reasoning_details": [item]}))
        looked: list[int] = []
        more = [{"index": _Index(i, looked), "text": "b"} for i in range(n)]
        acc.add_event(_event({"reasoning_details": more}, "stop"))
        extra = acc.result().choices[0].message.model_extra or {}
        assert [d["text"] for d in extra["reasoning_details"]] == ["ab"] * n
        assert len(looked) <= 4 * n, one_event  # a scan: about n * n / 2 comparisons
