"""`AiohttpTransport`: an `httpx.AsyncBaseTransport` that carries requests over aiohttp.

Why: httpcore's pool does O(connections^2) work per request, which dominates fan-outs of
thousands of passes (see docs/providers.md). This transport keeps httpx as the client API and
must behave like httpx's own: errors surface as httpx's exception classes, SSE/chunked bodies
stream incrementally, small bodies with a Content-Length are read inside the transport and the
connection released at once, a cancelled request's connection is closed (never pooled).
It never blocks the event loop and creates its `aiohttp.ClientSession` inside the running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler
from yarl import URL

from treadle.llm.http_errors import StaleConnectionError, TLSMismatchError, is_tls_mismatch

__all__ = [
    "DEFAULT_CONNECTION_LIMIT",
    "MAX_BUFFERED_BODY_BYTES",
    "AiohttpTransport",
    "map_aiohttp_error",
]

DEFAULT_CONNECTION_LIMIT = 1000
"""Default cap on open connections: an unbounded pool made a busy loop time itself out."""
MAX_BUFFERED_BODY_BYTES = 4 * 1024 * 1024
"""Bodies with a Content-Length up to this size are read fully inside the transport."""


# Whether the connection of the current request came from the pool. Set by `_Connector.connect`,
# which runs inside the request's own task, and read when the request fails before its response.
_reused: contextvars.ContextVar[bool] = contextvars.ContextVar("treadle_reused", default=False)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, telling fresh connections from reused ones and bounding TLS handshakes.

    A request that dies before any response byte may be re-sent for free only on a reused
    keep-alive connection (the server closed it while idle and never saw the request). A server
    that accepts TCP but never answers the TLS ClientHello is almost always plain HTTP on that
    port (llama.cpp's server waits silently for a request line): the handshake gets half the
    connect timeout instead of hanging until it, so `https://` to such a port fails fast.
    """

    async def connect(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature
    ) -> aiohttp.connector.Connection:
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        # A mark on the protocol, not a set of ids: an id may be reused by a fresh connection.
        # (A failure inside `connect` is a connector error, never taken for a stale connection,
        # so the flag need not be reset before it.)
        reused = getattr(protocol, "_treadle_used", False)
        _reused.set(reused)
        if not reused and protocol is not None:
            protocol._treadle_used = True  # type: ignore[attr-defined]
        return conn

    async def _wrap_create_connection(
        self, *args: Any, **kwargs: Any
    ) -> tuple[asyncio.Transport, ResponseHandler]:
        timeout = kwargs.get("timeout")
        if kwargs.get("ssl") and timeout is not None and timeout.sock_connect:
            kwargs.setdefault("ssl_handshake_timeout", timeout.sock_connect / 2)
        return await super()._wrap_create_connection(*args, **kwargs)


def map_aiohttp_error(
    exc: BaseException,
    request: httpx.Request,
    *,
    before_response: bool = False,
    reused: bool = False,
) -> httpx.TransportError | None:
    """The httpx exception httpx itself would raise for this aiohttp failure (None: not ours).

    `before_response` says no response byte had arrived and `reused` that the connection came
    from the pool: a disconnect then is a stale connection (`StaleConnectionError`).
    """
    message = str(exc) or type(exc).__name__
    if (
        before_response
        and reused
        and isinstance(
            exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionResetError
        )
        and not isinstance(exc, aiohttp.ClientConnectorError)
    ):
        return StaleConnectionError(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError) and is_tls_mismatch(exc):
        return TLSMismatchError(message, request=request)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientOSError | ConnectionError):
        return httpx.ReadError(message, request=request)
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx.UnsupportedProtocol(message, request=request)
    if isinstance(exc, aiohttp.ClientError):
        return httpx.NetworkError(message, request=request)
    return None


class _ResponseStream(httpx.AsyncByteStream):
    """A streamed aiohttp body as httpx sees it; closing early closes the connection."""

    __slots__ = ("_request", "_response")

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request | str) -> None:
        self._response = response
        # The fast path passes the URL: an httpx.Request is built only if an error needs one.
        self._request = request

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except GeneratorExit:
            # The reader stopped early (say, at an SSE `[DONE]`): not a failure. `aclose()`
            # returns the connection to the pool when the body is complete, else closes it.
            raise
        except BaseException as exc:
            self._response.close()
            request = self._request
            if isinstance(request, str):
                request = httpx.Request("POST", request)
            mapped = map_aiohttp_error(exc, request)
            if mapped is not None:
                raise mapped from exc
            raise

    async def aclose(self) -> None:
        response = self._response
        if response.content.at_eof():
            response.release()
        else:
            response.close()  # part of the body is unread: the connection cannot be reused


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx transport over one `aiohttp.ClientSession`, bound to the loop of its first request.

    `limit` caps open connections (None: aiohttp's unlimited pool; not recommended for fan-outs).
    """

    def __init__(
        self,
        *,
        limit: int | None = DEFAULT_CONNECTION_LIMIT,
        keepalive_timeout: float = 30.0,
    ) -> None:
        self._limit = limit
        self._keepalive_timeout = keepalive_timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeouts: dict[tuple[Any, Any], aiohttp.ClientTimeout] = {}
        self._closed = False

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The aiohttp session, once the first request created it."""
        return self._session

    def _get_session(self) -> aiohttp.ClientSession:
        session = self._session
        if session is not None:
            if asyncio.get_running_loop() is not self._loop:
                raise RuntimeError(
                    "This AiohttpTransport belongs to another event loop; create one per loop "
                    "(treadle.llm.get_client does this for you)."
                )
            return session
        if self._closed:
            raise RuntimeError("This AiohttpTransport is closed; create a new client.")
        self._loop = asyncio.get_running_loop()
        connector = _Connector(
            limit=self._limit or 0,
            limit_per_host=0,
            keepalive_timeout=self._keepalive_timeout,
            ttl_dns_cache=300,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,  # httpx decodes Content-Encoding itself
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            trust_env=False,
        )
        self._session = session
        return session

    def _timeout(self, request: httpx.Request) -> aiohttp.ClientTimeout:
        spec = request.extensions.get("timeout") or {}
        return self._timeout_for(spec.get("connect"), spec.get("read"))

    def _timeout_for(self, connect: float | None, read: float | None) -> aiohttp.ClientTimeout:
        key = (connect, read)
        timeout = self._timeouts.get(key)
        if timeout is None:
            # Pool waits are not timed: with a bounded pool a fan-out queues there by design.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=key[0], sock_read=key[1])
            self._timeouts[key] = timeout
        return timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request` over aiohttp; return a buffered or streamed `httpx.Response`."""
        session = self._get_session()
        body = request.content if isinstance(request.stream, httpx.ByteStream) else None
        if body is None:
            body = await request.aread()
        try:
            response = await session.request(
                request.method,
                URL(str(request.url), encoded=True),
                headers=request.headers.multi_items(),
                data=body or None,
                timeout=self._timeout(request),
                allow_redirects=False,
                compress=None,
            )
        except BaseException as exc:
            mapped = map_aiohttp_error(exc, request, before_response=True, reused=_reused.get())
            if mapped is not None:
                raise mapped from exc
            raise
        length = response.content_length
        if length is not None and length <= MAX_BUFFERED_BODY_BYTES:
            try:
                content = await response.read()
            except BaseException as exc:
                response.close()
                mapped = map_aiohttp_error(exc, request)
                if mapped is not None:
                    raise mapped from exc
                raise
            response.release()
            return httpx.Response(
                response.status,
                headers=response.raw_headers,
                stream=httpx.ByteStream(content),
                extensions={"http_version": b"HTTP/1.1"},
            )
        return httpx.Response(
            response.status,
            headers=response.raw_headers,
            stream=_ResponseStream(response, request),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeouts: httpx.Timeout
    ) -> aiohttp.ClientResponse:
        """POST without httpx objects; returns once the response headers arrived."""
        try:
            return await self._get_session().request(
                "POST",
                URL(url, encoded=True),
                headers=headers,
                data=body,
                timeout=self._timeout_for(timeouts.connect, timeouts.read),
                allow_redirects=False,
                compress=None,
                auto_decompress=True,
            )
        except BaseException as exc:
            mapped = map_aiohttp_error(
                exc, httpx.Request("POST", url), before_response=True, reused=_reused.get()
            )
            if mapped is not None:
                raise mapped from exc
            raise

    async def post_buffered(
        self, url: str, body: bytes, headers: Mapping[str, str], timeouts: httpx.Timeout
    ) -> tuple[int, Any, bytes]:
        """POST `body` and read the whole reply: `(status, headers, content)`, decompressed.

        The hot path of `ModelClient.complete` when Treadle owns the client: no `httpx.Request`
        or `httpx.Response` is built (about a third of a round's CPU). Failures surface as the
        same httpx exceptions `handle_async_request` raises.
        """
        response = await self._post(url, body, headers, timeouts)
        try:
            content = await response.read()
        except BaseException as exc:
            response.close()
            mapped = map_aiohttp_error(exc, httpx.Request("POST", url))
            if mapped is not None:
                raise mapped from exc
            raise
        response.release()
        return response.status, response.headers, content

    async def post_stream(
        self, url: str, body: bytes, headers: Mapping[str, str], timeouts: httpx.Timeout
    ) -> tuple[int, Any, _ResponseStream]:
        """POST `body` and return `(status, headers, body stream)` as soon as the headers arrive.

        The streaming twin of `post_buffered`: no httpx objects on the way. The caller must
        `aclose()` the stream; closing it before the end closes the connection instead of
        returning it to the pool. Failures surface as the same httpx exceptions.
        """
        response = await self._post(url, body, headers, timeouts)
        return response.status, response.headers, _ResponseStream(response, url)

    async def aclose(self) -> None:
        """Close the aiohttp session and every pooled connection."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def close_now(self) -> None:
        """Best-effort synchronous close, for a loop that can no longer run coroutines."""
        self._closed = True
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        connector = session.connector
        if connector is not None:
            # The loop is closed: the sockets die with the process if this fails.
            with contextlib.suppress(RuntimeError):
                connector._close()
        session._connector = None
