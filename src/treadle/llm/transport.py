"""The one transport seam of `ModelClient`: two calls, a buffered POST and a streamed POST.

`PoolTransport` carries them over Treadle's own pool (`treadle._http`), one per event loop.
`HttpxTransport` adapts a user's `httpx.AsyncClient` (`Provider(http_client=...)`) to the same
two calls and turns httpx's exceptions into `treadle._http.errors` once, here, so `llm` classifies
every failure in one place whichever transport carried it. Replies are `treadle._http.reply`
values. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from treadle._http import errors as http
from treadle._http.pool import NetworkOptions, Pool
from treadle._http.protocol import MAX_BODY_BYTES
from treadle._http.reply import (
    UPGRADE,
    Headers,
    Reply,
    StreamReply,
    Timeouts,
    headers_of,
    unsupported,
)

if TYPE_CHECKING:
    import httpx

__all__ = ["HttpxTransport", "PoolTransport", "Transport"]


class Transport(Protocol):
    """What `ModelClient` needs from an HTTP client."""

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> Reply: ...

    async def post_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> StreamReply: ...

    async def aclose(self) -> None: ...

    def close_now(self) -> None: ...


class PoolTransport:
    """Treadle's own pool, bound to the event loop of its first request."""

    def __init__(
        self, options: NetworkOptions | None = None, *, max_connections: int | None = None
    ) -> None:
        self._options = options
        self._max_connections = max_connections
        self._pool: Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def pool(self) -> Pool | None:
        """The pool, once the first request created it."""
        return self._pool

    def _get_pool(self) -> Pool:
        pool = self._pool
        loop = asyncio.get_running_loop()
        if pool is not None and loop is self._loop:
            return pool
        if self._closed:
            raise http.PoolClosed("This connection pool is closed; create a new client.")
        if pool is not None:
            raise RuntimeError(
                "This connection pool belongs to another event loop; create one per loop "
                "(treadle.llm.get_client does this for you)."
            )
        self._loop = loop
        if self._max_connections is None:
            pool = self._pool = Pool(options=self._options)
        else:
            pool = self._pool = Pool(options=self._options, max_connections=self._max_connections)
        return pool

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> Reply:
        """POST `body` and read the whole reply."""
        return await self._get_pool().post(url, body, headers, timeouts)

    async def post_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> StreamReply:
        """POST `body`; the reply once its head arrived (close its body)."""
        return await self._get_pool().post_stream(url, body, headers, timeouts)

    async def aclose(self) -> None:
        """Close every pooled connection."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()

    def close_now(self) -> None:
        """Best-effort synchronous close, for a loop that can no longer run coroutines."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


class HttpxTransport:
    """A user's `httpx.AsyncClient` behind the same two calls (Treadle never closes it)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> Reply:
        """POST `body` through the user's client and read the whole reply."""
        response = await self._send(url, body, headers, timeouts)
        try:
            # Read as a stream, never `response.content`: the pool's cap on the decompressed
            # size holds here too (a small gzip bomb must not grow to gigabytes in memory).
            parts = [piece async for piece in _HttpxBody(response, url)]
        finally:
            await response.aclose()
        return Reply(response.status_code, _headers(response.headers), b"".join(parts))

    async def _send(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> httpx.Response:
        """POST `body`; the response once its head arrived (its body still to read)."""
        with _mapped(url):
            request = self.client.build_request(
                "POST", url, content=body, headers=headers, timeout=_httpx_timeout(timeouts)
            )
            response = await self.client.send(request, stream=True)
        try:
            _refuse_unsupported(response.status_code, url)
            _refuse_length(response.headers.get("content-length"), url)
        except http.HTTPError:
            await response.aclose()
            raise
        return response

    async def post_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> StreamReply:
        """POST `body` through the user's client; the reply once its head arrived."""
        response = await self._send(url, body, headers, timeouts)
        return StreamReply(
            response.status_code, _headers(response.headers), _HttpxBody(response, url)
        )

    async def aclose(self) -> None:
        """Nothing: the client is the user's."""

    def close_now(self) -> None:
        """Nothing: the client is the user's."""


class _HttpxBody:
    """An httpx streamed response as a `BodyStream` (errors mapped as the pool's are).

    httpx decodes the content coding it offered; the decoded size is bounded by the pool's
    `MAX_BODY_BYTES`, with the pool's error, counted as the pieces arrive.
    """

    def __init__(self, response: httpx.Response, url: str) -> None:
        self._response = response
        self._url = url
        self._chunks: AsyncIterator[bytes] | None = None
        self._closed = False
        self._size = 0

    def __aiter__(self) -> _HttpxBody:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise http.BodyClosed("The reply body was read after it was closed.", url=self._url)
        if self._chunks is None:
            self._chunks = self._response.aiter_bytes()
        with _mapped(self._url):
            piece = await anext(self._chunks)
        self._size += len(piece)
        if self._size > MAX_BODY_BYTES:
            raise http.DecodeError(f"The reply body is over {MAX_BODY_BYTES} bytes.", url=self._url)
        return piece

    async def aclose(self) -> None:
        """Close the response (httpx closes its connection unless it was read to the end)."""
        self._closed = True
        await self._response.aclose()


def _headers(headers: httpx.Headers) -> Headers:
    """httpx's headers as the pool reads them (`headers_of` of their bytes), not decoded by
    httpx's guess of the encoding: an id reads the same through either transport."""
    return headers_of(headers.raw)


def _httpx_timeout(timeouts: Timeouts) -> httpx.Timeout:
    import httpx

    return httpx.Timeout(
        connect=timeouts.connect, read=timeouts.read, write=timeouts.connect, pool=timeouts.pool
    )


class _mapped:
    """Turns httpx's exceptions into `treadle._http.errors` (the one place that knows both)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        import httpx

        if exc is None or not isinstance(exc, httpx.HTTPError):
            return
        message, url = str(exc) or type(exc).__name__, self.url
        mapped: http.HTTPError
        if isinstance(exc, httpx.PoolTimeout):
            mapped = http.PoolTimeout(message, url=url)
        elif isinstance(exc, httpx.ConnectTimeout):
            mapped = http.ConnectTimeout(message, url=url)
        elif isinstance(exc, httpx.ProxyError):
            mapped = http.ProxyError(message, url=url)
        elif isinstance(exc, httpx.ConnectError):
            text = message.lower()
            if "ssl" in text or "certificate" in text or "tls" in text:
                mapped = http.TLSError(message, url=url, plaintext_peer=_plaintext(text))
            else:
                mapped = http.ConnectError(message, url=url)
        elif isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
            mapped = http.ReadTimeout(message, url=url)
        elif isinstance(exc, httpx.WriteError):
            mapped = http.WriteError(message, url=url)
        elif isinstance(exc, httpx.DecodingError):
            mapped = http.DecodeError(message, url=url)
        elif isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
            mapped = http.InvalidURL(message, url=url)
        elif isinstance(exc, httpx.LocalProtocolError):
            # The request was refused before it left (h11: a header name or value that is not
            # valid HTTP), as the pool refuses it: never retried. httpx's message may quote the
            # value (an API key), so it is not repeated.
            mapped = http.InvalidHeader(
                "The request has a header name or value that is not valid HTTP (httpx "
                "LocalProtocolError); check the Provider's api_key and headers.",
                url=url,
            )
        elif isinstance(exc, httpx.RemoteProtocolError):
            mapped = _remote_protocol(message, url)
        else:  # ReadError, CloseError, other transport failures: the connection was lost
            mapped = http.RemoteProtocolError(f"{type(exc).__name__}: {message}", url=url)
        raise mapped from exc


# h11's words for replies the pool refuses as `UnsupportedReply` (never retried): the same reply
# through either transport gets the same typed error and the same retry decision.
_UNSUPPORTED = (
    ("_SWITCH_UPGRADE", UPGRADE),
    ("Only Transfer-Encoding: chunked", "The reply's Transfer-Encoding is not supported"),
    ("status_code should be in range", "The reply's status is not 100-599"),
)


# Every way h11 and httpcore say the connection ended under the reply (their sources raise
# `RemoteProtocolError` for these and for malformed replies alike): a lost connection, retried.
_CONNECTION_LOST = (
    "Server disconnected",  # httpcore: closed before any reply byte
    "peer closed connection",  # h11: a body cut short (by length or chunks)
    "peer unexpectedly closed",  # h11: a head cut short
    "peer state is ERROR",  # h11: a read after one of the above
    "ConnectionClosed",  # httpcore: h11 saw the close in a state that has no reply yet
)


def _remote_protocol(message: str, url: str) -> http.RemoteProtocolError:
    """httpx's `RemoteProtocolError` as the pool's error for the same reply: a reply h11 refuses
    to parse is a `MalformedReply` (never retried, as llhttp's refusals in the pool); only a
    connection lost under the reply stays a plain `RemoteProtocolError` (retried)."""
    for marker, said in _UNSUPPORTED:
        if marker in message:
            return http.UnsupportedReply(f"{said} (httpx: {message}).", url=url)
    if any(marker in message for marker in _CONNECTION_LOST):
        return http.RemoteProtocolError(f"RemoteProtocolError: {message}", url=url)
    return http.MalformedReply(f"The reply is not valid HTTP/1.1 (httpx: {message}).", url=url)


def _refuse_length(length: str | None, url: str) -> None:
    """A `Content-Length` over the cap refused before the body is read, as the pool does."""
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        raise http.DecodeError(
            f"The reply body ({length} bytes) is over {MAX_BODY_BYTES}.", url=url
        )


def _refuse_unsupported(status: int, url: str) -> None:
    """A final status the pool refuses (outside 100-599, a 101) refused here too."""
    if not 200 <= status <= 599:
        problem = unsupported(status, None)
        if problem is not None:
            problem.url = url
            raise problem


def _plaintext(text: str) -> bool:
    markers = ("wrong_version_number", "wrong version number", "record layer failure",
               "packet length too long", "http request")  # fmt: skip
    return any(marker in text for marker in markers)
