"""The HTTP client of a streamable HTTP connection, with every reply capped in size.

The SDK's streamable HTTP transport reads a JSON reply whole (`response.aread()`) and an SSE
stream event by event. Events it caps itself (`max_sse_event_size`, given the server's
`max_message_bytes`); JSON replies are capped here, by a transport wrapper whose body stream
stops with an `httpx2.StreamError` (which the SDK turns into an error reply to the call) as soon
as a reply passes the cap, or before reading any of it when its `Content-Length` says it will.
This module must never hold more than the cap of one reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx2

__all__ = ["ReplyTooLarge", "capped_client"]


class ReplyTooLarge(httpx2.StreamError):
    """A server's JSON reply passed the connection's `max_message_bytes`."""


class _CappedBody(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, cap: int, url: str, declared: int) -> None:
        self._inner = inner
        self._cap = cap
        self._url = url
        self._declared = declared

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._declared > self._cap:  # refused before a byte of it is read
            raise _too_large(self._url, self._cap, self._declared)
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._cap:
                raise _too_large(self._url, self._cap, seen)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _too_large(url: str, cap: int, seen: int) -> ReplyTooLarge:
    return ReplyTooLarge(
        f"the reply from {url} is over its max_message_bytes cap of {cap:,} bytes ({seen:,} "
        "so far); raise the cap with MCPServer.http(..., max_message_bytes=...) if such replies "
        "are expected"
    )


class _CappedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, cap: int) -> None:
        self._inner = inner
        self._cap = cap

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        kind = response.headers.get("content-type", "").lower()
        if kind.startswith("text/event-stream"):
            return response  # capped per event by the SDK; the stream itself may last long
        length = response.headers.get("content-length", "")
        declared = int(length) if length.isdigit() else 0
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_CappedBody(response.stream, self._cap, str(request.url), declared),
            request=request,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def capped_client(
    headers: Mapping[str, str], timeout: httpx2.Timeout, cap: int
) -> httpx2.AsyncClient:
    """An HTTP client whose JSON replies may not exceed `cap` bytes."""
    return httpx2.AsyncClient(
        headers=dict(headers),
        timeout=timeout,
        transport=_CappedTransport(httpx2.AsyncHTTPTransport(), cap),
    )
