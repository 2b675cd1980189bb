"""The HTTP client of a streamable HTTP connection, with every reply capped in size.

The SDK's streamable HTTP transport reads a JSON reply whole (`response.aread()`) and an SSE
stream event by event. Events it caps itself (`max_sse_event_size`, given the server's
`max_message_bytes`); JSON replies are capped here, by a transport wrapper whose body stream
stops with an `httpx2.StreamError` (which the SDK turns into an error reply to the call) as soon
as a reply passes the cap, or before reading any of it when its `Content-Length` says it will.
The cap counts DECODED bytes: a `gzip` or `deflate` reply is inflated here, a bounded piece at a
time, and a reply in any other content coding is refused (requests ask only for those two), so a
small compressed body can never inflate past the cap. A reply over the cap also trips the client
(`capped_client(..., tripped=...)`): the connection's read stream (`TrippedStream`) then ends with
a `TransportFault`, so the call fails saying why and the next call starts a fresh connection
rather than reuse one whose reply was cut off.

The SDK types a reply with one pydantic call on the runtime loop (a reply of 1 MiB of small
content blocks held it 150 ms), so a reply over `PARSE_OFF_LOOP_BYTES` (a JSON body, or the data
of one server-sent event) is parsed here instead, on a worker thread as the stdio reader parses
its lines (`json.loads`, then only the envelope typed), and "parked": the SDK is handed a tiny
placeholder reply naming it, which `TrippedStream` swaps for the parked message on its way to
the session. Only responses are parked (and only from `message` events): the SDK reads the
placeholder as its call's reply. A large notification or server request is handed on slimmed
instead (its params cut to what Treadle reads, `treadle.mcp.parse.slim`): the SDK would type
all of it on the loop.
This module must never hold more than the cap of one reply.
"""

from __future__ import annotations

import json
import secrets
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx2
import mcp_types as types
from mcp.shared.message import SessionMessage

from treadle.mcp.stdio import (
    PARSE_OFF_LOOP_BYTES,
    MessageTooLarge,
    TransportFault,
    _parse,
)
from treadle.runtime.threads import run_internal_io

__all__ = ["ReplyTooLarge", "Trip", "TrippedStream", "capped_client"]


_PARKED = "treadle_parked"


class Trip:
    """Set once a reply of the connection went over the cap (or was not JSON-RPC); says which.
    Also holds the connection's parked messages (parsed off the loop), by placeholder token."""

    __slots__ = ("fault", "parked", "reason")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.fault: type[TransportFault] = MessageTooLarge
        self.parked: dict[str, SessionMessage] = {}

    async def park(self, data: bytes, label: str) -> bytes:
        """`data` (one JSON-RPC message) parsed on a worker thread; a response is kept and the
        placeholder reply to hand the SDK in its place returned. Any other message (a
        notification or a server's request) is not parked, since the SDK reads a placeholder as
        its call's reply: it comes back slimmed (`treadle.mcp.parse.slim`), small for the SDK
        to type on the loop."""
        message = await run_internal_io(_parse, data, label)
        if isinstance(message, TransportFault):
            self.reason, self.fault = str(message).rstrip("."), type(message)
            message_id: Any = 0
        elif not isinstance(message.message, types.JSONRPCResponse | types.JSONRPCError):
            return message.message.model_dump_json(by_alias=True, exclude_unset=True).encode()
        else:
            token = secrets.token_hex(16)
            self.parked[token] = message
            message_id = getattr(message.message, "id", 0)
        result = {_PARKED: token} if isinstance(message, SessionMessage) else {}
        return json.dumps({"jsonrpc": "2.0", "id": message_id, "result": result}).encode()

    def unpark(self, item: Any) -> Any:
        """`item` from the SDK, or the message its placeholder stands for."""
        message = getattr(item, "message", None)
        if not isinstance(message, types.JSONRPCResponse) or not isinstance(message.result, dict):
            return item
        token = message.result.get(_PARKED)
        real = self.parked.pop(token, None) if isinstance(token, str) else None
        if real is None:
            return item
        inner = real.message
        if isinstance(inner, types.JSONRPCResponse | types.JSONRPCError):
            inner.id = message.id  # the SDK may have put its request's own id on the placeholder
        return SessionMessage(inner, metadata=item.metadata)


class TrippedStream:
    """A streamable HTTP connection's read stream that ends, with a `MessageTooLarge` fault as
    its last item, at the first item after its client was tripped (that item is the SDK's error
    reply for the capped call; the fault tells the call why instead)."""

    def __init__(self, inner: Any, trip: Trip) -> None:
        self._inner = inner
        self._trip = trip

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        """The next message, or the fault once the client was tripped."""
        if self._trip.reason is None:
            item = await self._inner.receive()
            if self._trip.reason is None:
                return self._trip.unpark(item)
        return self._trip.fault(
            f"{self._trip.reason}. The connection was closed; the next call opens a new one."
        )

    async def aclose(self) -> None:
        """Close the inner stream, dropping any message still parked (its call is over)."""
        self._trip.parked.clear()
        await self._inner.aclose()


class ReplyTooLarge(httpx2.StreamError):
    """A server's JSON reply passed the connection's `max_message_bytes`."""


# Each inflation step yields at most this many bytes, so a bomb is caught a piece at a time.
_PIECE = 64 * 1024
_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": 32 + zlib.MAX_WBITS,
}


def _codings(header: str) -> list[str]:
    return [
        c.strip().lower() for c in header.split(",") if c.strip().lower() not in ("", "identity")
    ]


def _inflate(decoders: list[zlib._Decompress], data: bytes, flush: bool = False) -> Iterator[bytes]:
    """`data` run through every decoder in turn (outermost coding first), in bounded pieces."""
    if not decoders:
        if data:
            yield data
        return
    first, rest = decoders[0], decoders[1:]
    while data:
        piece = first.decompress(data, _PIECE)
        data = first.unconsumed_tail
        yield from _inflate(rest, piece)
    if flush:
        yield from _inflate(rest, first.flush(), flush=True)


class _CappedBody(httpx2.AsyncByteStream):
    def __init__(
        self,
        inner: httpx2.AsyncByteStream,
        cap: int,
        url: str,
        declared: int,
        coding: str,
        trip: Trip,
    ) -> None:
        self._trip = trip
        self._inner = inner
        self._cap = cap
        self._url = url
        self._declared = declared
        self._coding = coding

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # The SDK reads a JSON reply whole (`aread`) anyway: kept here whole (capped), then
        # handed over as it is, or, when large, as the placeholder of its parked message.
        held: list[bytes] = []
        size = 0
        try:
            async for piece in self._pieces():
                held.append(piece)
                size += len(piece)
        except ReplyTooLarge as error:
            self._trip.reason = str(error)
            raise
        body = b"".join(held)
        del held
        if size > PARSE_OFF_LOOP_BYTES:
            yield await self._trip.park(body, self._url)
        elif body:
            yield body

    async def _pieces(self) -> AsyncIterator[bytes]:
        codings = _codings(self._coding)
        if not codings and self._declared > self._cap:  # refused before a byte of it is read
            raise _too_large(self._url, self._cap, self._declared)
        unknown = [c for c in codings if c not in _WBITS]
        if unknown:
            raise ReplyTooLarge(
                f"the reply from {self._url} is in the content coding {unknown[0]!r}, which "
                "cannot be capped while it decodes; serve JSON replies plain, gzip or deflate"
            )
        # the outermost coding is listed last, so it is undone first
        decoders = [zlib.decompressobj(_WBITS[c]) for c in reversed(codings)]
        seen = 0
        async for chunk in self._inner:
            try:
                for piece in _inflate(decoders, chunk):
                    seen += len(piece)
                    if seen > self._cap:
                        raise _too_large(self._url, self._cap, seen)
                    yield piece
            except zlib.error as error:
                raise httpx2.DecodingError(f"the reply from {self._url}: {error}") from error
        for piece in _inflate(decoders, b"", flush=True):
            seen += len(piece)
            if seen > self._cap:
                raise _too_large(self._url, self._cap, seen)
            yield piece

    async def aclose(self) -> None:
        await self._inner.aclose()


class _ParkingEvents(httpx2.AsyncByteStream):
    """A server-sent event stream passed on event by event, the data of each event over
    `PARSE_OFF_LOOP_BYTES` replaced by the placeholder of its parked message (an event past
    `cap` is passed on as it is, for the SDK to refuse)."""

    def __init__(self, inner: httpx2.AsyncByteStream, cap: int, url: str, trip: Trip) -> None:
        self._inner = inner
        self._cap = cap
        self._url = url
        self._trip = trip

    async def __aiter__(self) -> AsyncIterator[bytes]:
        event: list[bytes] = []  # the lines of the event under way, each with its line end
        size = 0  # bytes in `event`
        partial: list[bytes] = []  # the pieces of the line under way
        pending = 0  # bytes in `partial` (a line is counted once, when it is whole, in `size`)
        passing = False  # the event under way went past the cap: passed on as it is, to its end
        async for chunk in self._inner:
            lines = chunk.split(b"\n")
            partial.append(lines[0])
            pending += len(lines[0])
            if len(lines) == 1:
                if size + pending > self._cap:  # too big to rewrite: on as it is
                    yield b"".join(event) + b"".join(partial)
                    event, partial, size, pending, passing = [], [], 0, 0, True
                continue
            lines[0] = b"".join(partial)
            partial = [lines.pop()]
            pending = len(partial[0])
            for line in lines:
                event.append(line + b"\n")
                size += len(line) + 1
                if line.rstrip(b"\r"):
                    continue
                # a blank line ends an event
                whole = passing or size > self._cap
                yield b"".join(event) if whole else await self._event(event, size)
                event, size, passing = [], 0, False
            if size + pending > self._cap:
                yield b"".join(event)
                event, size, passing = [], 0, True
        rest = b"".join(event) + b"".join(partial)
        if rest:
            yield rest

    async def _event(self, lines: list[bytes], size: int) -> bytes:
        if size <= PARSE_OFF_LOOP_BYTES:
            return b"".join(lines)
        data = [line for line in lines if line.startswith(b"data:")]
        # Only a `message` event (the SDK reads no other kind) with data is a candidate: a
        # comment, a `ping` or any other event passes untouched, whatever it holds.
        kinds = [_field_value(line, 6) for line in lines if line.startswith(b"event:")]
        if not data or (kinds and kinds[-1] != b"message"):
            return b"".join(lines)
        others = [line for line in lines[:-1] if not line.startswith(b"data:")]
        payload = b"\n".join(_field_value(line) for line in data)
        # a small message in a large event (a long `id:`) is cheap for the SDK to type itself
        small = len(payload) <= PARSE_OFF_LOOP_BYTES
        if small:
            return b"".join(lines)
        placeholder = await self._trip.park(payload, self._url)
        return b"".join(others) + b"data: " + placeholder + b"\n\n"

    async def aclose(self) -> None:
        await self._inner.aclose()


def _field_value(line: bytes, start: int = 5) -> bytes:
    """The value of an SSE field line (`data:` unless `start` says otherwise): past the colon
    and one space, without its line end."""
    value = line[start:].rstrip(b"\n").rstrip(b"\r")
    return value[1:] if value.startswith(b" ") else value


def _too_large(url: str, cap: int, seen: int) -> ReplyTooLarge:
    return ReplyTooLarge(
        f"the reply from {url} is over its max_message_bytes cap of {cap:,} bytes ({seen:,} "
        "so far); raise the cap with MCPServer.http(..., max_message_bytes=...) if such replies "
        "are expected"
    )


class _CappedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, cap: int, trip: Trip) -> None:
        self._inner = inner
        self._cap = cap
        self._trip = trip

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        kind = response.headers.get("content-type", "").lower()
        if kind.startswith("text/event-stream"):
            # Capped per event by the SDK; the stream itself may last long. Large events are
            # parked (parsed off the loop) on their way.
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _ParkingEvents(
                response.stream, self._cap, str(request.url), self._trip
            )
            return response
        length = response.headers.get("content-length", "")
        declared = int(length) if length.isdigit() else 0
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        coding = response.headers.get("content-encoding", "")
        # decoded here (and capped as it decodes), so the client must not decode it again
        headers = [(k, v) for k, v in response.headers.items() if k.lower() != "content-encoding"]
        return httpx2.Response(
            response.status_code,
            headers=headers,
            stream=_CappedBody(
                response.stream, self._cap, str(request.url), declared, coding, self._trip
            ),
            request=request,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def capped_client(
    headers: Mapping[str, str], timeout: httpx2.Timeout, cap: int, trip: Trip | None = None
) -> httpx2.AsyncClient:
    """An HTTP client whose JSON replies may not exceed `cap` bytes; the first that does sets
    `trip` (see `TrippedStream`)."""
    return httpx2.AsyncClient(
        headers={"accept-encoding": "gzip, deflate", **dict(headers)},
        timeout=timeout,
        transport=_CappedTransport(httpx2.AsyncHTTPTransport(), cap, trip or Trip()),
    )
