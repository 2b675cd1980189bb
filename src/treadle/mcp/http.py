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
rather than reuse one whose reply was cut off. This module must never hold more than the cap of
one reply.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx2

from treadle.mcp.stdio import MessageTooLarge

__all__ = ["ReplyTooLarge", "Trip", "TrippedStream", "capped_client"]


class Trip:
    """Set once a reply of the connection went over the cap; says which."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None


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
                return item
        return MessageTooLarge(
            f"{self._trip.reason}. The connection was closed; the next call opens a new one."
        )

    async def aclose(self) -> None:
        """Close the inner stream."""
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
        try:
            async for piece in self._pieces():
                yield piece
        except ReplyTooLarge as error:
            self._trip.reason = str(error)
            raise

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
            return response  # capped per event by the SDK; the stream itself may last long
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
