"""Large MCP replies over streamable HTTP are parsed off the loop and "parked": the SDK is handed
a small placeholder, which the connection's read stream swaps back for the parsed message.

The event-stream rewriter is fed real bytes split at awkward places (inside a line, between
`\\r` and `\\n`, one byte at a time); what comes out must be what an SSE reader needs: small
events untouched, a large one replaced by one `data:` line naming its parked message, which
unparks to the message sent. A large reply that is not JSON-RPC trips the connection with a
`MalformedMessage` fault.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest

pytest.importorskip("mcp")

from mcp.shared.message import SessionMessage
from mcp_types import jsonrpc_message_adapter

from treadle.mcp.http import Trip, TrippedStream, _ParkingEvents
from treadle.mcp.stdio import PARSE_OFF_LOOP_BYTES, MalformedMessage
from treadle.runtime import get_runtime


class _Bytes(httpx2.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece


def _reply(blocks: int, message_id: int = 7) -> bytes:
    content = [{"type": "text", "text": "b"} for _ in range(blocks)]
    reply = {"jsonrpc": "2.0", "id": message_id, "result": {"content": content}}
    return json.dumps(reply, separators=(",", ":")).encode()


def _events(data: bytes) -> list[bytes]:
    """The `data` of each event in an SSE byte stream (lines joined as an SSE reader does)."""
    events: list[bytes] = []
    current: list[bytes] = []
    for line in data.replace(b"\r\n", b"\n").split(b"\n"):
        if not line:
            if current:
                events.append(b"\n".join(current))
            current = []
        elif line.startswith(b"data:"):
            value = line[5:]
            current.append(value[1:] if value.startswith(b" ") else value)
    return events


async def _rewrite(stream: bytes, cut: int, trip: Trip, cap: int = 4 * 1024 * 1024) -> bytes:
    pieces = [stream[i : i + cut] for i in range(0, len(stream), cut)]
    parking = _ParkingEvents(_Bytes(pieces), cap, "http://peer/mcp", trip)
    return b"".join([piece async for piece in parking])


@pytest.mark.parametrize("cut", [1, 7, 4096, 1 << 30])
def test_a_large_event_is_parked_and_small_ones_pass_untouched(cut: int) -> None:
    big = _reply(PARSE_OFF_LOOP_BYTES // 20)
    assert len(big) > PARSE_OFF_LOOP_BYTES
    half = big.index(b"},{", len(big) // 2) + 2  # data lines split between two JSON values
    small = json.dumps({"jsonrpc": "2.0", "method": "notifications/progress"}).encode()
    stream = (
        b": keep-alive\n\nevent: message\ndata: " + small + b"\n\n"
        b"event: message\r\nid: 9\r\ndata: " + big[:half] + b"\r\ndata:" + big[half:] + b"\r\n\r\n"
    )
    trip = Trip()
    out = get_runtime().run(_rewrite(stream, cut, trip))
    assert out.startswith(b": keep-alive\n\nevent: message\ndata: " + small + b"\n\n")
    assert b"id: 9\r\n" in out  # the event's other fields stay
    first, placeholder = _events(out)
    assert first == small and len(placeholder) < 200
    # the placeholder, once the SDK typed it, unparks to the message sent (data lines rejoined
    # with a newline, which JSON reads as whitespace)
    typed = jsonrpc_message_adapter.validate_json(placeholder, by_name=False)
    real = trip.unpark(SessionMessage(typed))
    assert (
        real.message.id == 7 and len(real.message.result["content"]) == PARSE_OFF_LOOP_BYTES // 20
    )
    assert trip.parked == {}


@pytest.mark.parametrize("cut", [7, 4096, 1 << 30])
def test_an_event_over_the_cap_passes_as_it_came_for_the_sdk_to_refuse(cut: int) -> None:
    big = _reply(PARSE_OFF_LOOP_BYTES // 10)
    stream = b"event: message\ndata: " + big + b"\n\nevent: message\ndata: {}\n\n"
    trip = Trip()
    out = get_runtime().run(_rewrite(stream, cut, trip, cap=len(big) // 2))
    assert out == stream
    assert trip.parked == {} and trip.reason is None


def test_a_large_reply_that_is_not_json_rpc_trips_the_connection() -> None:
    trip = Trip()

    async def go() -> Any:
        placeholder = await trip.park(b"[" + b"1," * PARSE_OFF_LOOP_BYTES + b"oops", "peer")
        assert placeholder is not None  # a fault: the placeholder of an empty reply
        typed = jsonrpc_message_adapter.validate_json(placeholder, by_name=False)

        class _Inner:
            async def receive(self) -> Any:
                return SessionMessage(typed)

        return await TrippedStream(_Inner(), trip).receive()

    fault = get_runtime().run(go())
    assert isinstance(fault, MalformedMessage)
    assert "not a JSON-RPC message" in str(fault) and "connection was closed" in str(fault)


def test_a_placeholder_a_server_made_up_is_passed_on_as_it_came() -> None:
    trip = Trip()
    forged = jsonrpc_message_adapter.validate_python(
        {"jsonrpc": "2.0", "id": 1, "result": {"treadle_parked": "guess"}}
    )
    item = SessionMessage(forged)
    assert trip.unpark(item) is item


def _big_note() -> bytes:
    note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "x" * 100_000}}
    return json.dumps(note).encode()


def _big_request() -> bytes:
    ping = {
        "jsonrpc": "2.0",
        "id": "s1",
        "method": "ping",
        "params": {"_meta": {"p": "x" * 100_000}},
    }
    return json.dumps(ping).encode()


@pytest.mark.parametrize(
    ("event", "slimmed"),
    [
        pytest.param(
            b"event: message\ndata: " + _big_note() + b"\n\n",
            {
                "jsonrpc": "2.0",
                "method": "notifications/message",
                "params": {"data": "x" * 1000 + "…"},
            },
            id="notification",
        ),
        pytest.param(
            b"data: " + _big_request() + b"\n\n",
            {"jsonrpc": "2.0", "id": "s1", "method": "ping", "params": {}},
            id="server-request",
        ),
    ],
)
@pytest.mark.parametrize("cut", [7, 4096, 1 << 30])
def test_a_large_notification_or_request_is_handed_on_slimmed(
    event: bytes, slimmed: dict[str, Any], cut: int
) -> None:
    # Not parked (a placeholder would stand in for the call's reply, which follows), but not
    # handed on as it came either: the SDK would type all of its params on the loop.
    assert len(event) > PARSE_OFF_LOOP_BYTES
    reply = b"event: message\ndata: " + _reply(1) + b"\n\n"
    trip = Trip()
    out = get_runtime().run(_rewrite(event + reply, cut, trip))
    first, second = _events(out)
    assert json.loads(first) == slimmed and len(first) < 2000
    assert second == _reply(1)
    assert trip.parked == {} and trip.reason is None


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(b": " + b"x" * 100_000 + b"\n\n", id="comment"),
        pytest.param(b"event: ping\ndata: " + b"x" * 100_000 + b"\n\n", id="other-event"),
        pytest.param(b"event: other\r\ndata: " + _big_note() + b"\r\n\r\n", id="other-json"),
        pytest.param(b"event: message\nid: " + b"x" * 100_000 + b"\ndata: {}\n\n", id="big-id"),
    ],
)
@pytest.mark.parametrize("cut", [7, 4096, 1 << 30])
def test_a_large_event_that_is_not_a_message_passes_as_it_came(event: bytes, cut: int) -> None:
    # Only a `message` event is read by the SDK: any other passes untouched, whatever it holds.
    assert len(event) > PARSE_OFF_LOOP_BYTES
    reply = b"event: message\ndata: " + _reply(1) + b"\n\n"
    trip = Trip()
    out = get_runtime().run(_rewrite(event + reply, cut, trip))
    assert out == event + reply
    assert trip.parked == {} and trip.reason is None


def test_messages_left_parked_are_dropped_when_the_connection_closes() -> None:
    trip = Trip()

    class _Inner:
        async def aclose(self) -> None:
            pass

    async def go() -> None:
        await trip.park(_reply(PARSE_OFF_LOOP_BYTES // 20), "peer")
        assert len(trip.parked) == 1
        await TrippedStream(_Inner(), trip).aclose()

    get_runtime().run(go())
    assert trip.parked == {}


@pytest.mark.parametrize("cut", [7, 4096, 65536, 1 << 30])
def test_an_event_just_under_the_cap_is_parked_however_it_is_cut(cut: int) -> None:
    # a long line arriving in many pieces is counted once (counted twice, an event over half
    # the cap passed whole to the SDK, which typed it on the loop: 170 ms for 1 MiB)
    big = _reply(PARSE_OFF_LOOP_BYTES // 10)
    stream = b"event: message\r\ndata: " + big + b"\r\n\r\n"
    trip = Trip()
    out = get_runtime().run(_rewrite(stream, cut, trip, cap=len(stream) + 1))
    (placeholder,) = _events(out)
    assert len(placeholder) < 200 and len(trip.parked) == 1
