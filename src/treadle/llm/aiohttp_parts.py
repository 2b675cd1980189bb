"""The aiohttp half of `AiohttpTransport`: httpx requests carried by one `aiohttp.ClientSession`.

Loaded on the first request that is not a chat-completion POST (`treadle.llm.lane` carries
those), so a process that only runs passes never imports aiohttp (about 170 ms). Behaves like
httpx's own transport: errors surface as httpx's exception classes, SSE/chunked bodies stream
incrementally, small bodies with a Content-Length are read at once and the connection released,
a cancelled request's connection is closed (never pooled).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler
from yarl import URL

from treadle.llm.http_errors import StaleConnectionError, TLSMismatchError, is_tls_mismatch

__all__ = ["close_session_now", "map_aiohttp_error", "new_session", "send"]

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


def new_session(limit: int | None, keepalive_timeout: float) -> aiohttp.ClientSession:
    """The session of one event loop (create it inside that loop)."""
    connector = _Connector(
        limit=limit or 0,
        limit_per_host=0,
        keepalive_timeout=keepalive_timeout,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,  # httpx decodes Content-Encoding itself
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
        trust_env=False,
    )


_timeouts: dict[tuple[Any, Any], aiohttp.ClientTimeout] = {}


def _timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    spec = request.extensions.get("timeout") or {}
    key = (spec.get("connect"), spec.get("read"))
    timeout = _timeouts.get(key)
    if timeout is None:
        if len(_timeouts) > 64:
            _timeouts.clear()
        # Pool waits are not timed: with a bounded pool a fan-out queues there by design.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=key[0], sock_read=key[1])
        _timeouts[key] = timeout
    return timeout


async def send(session: aiohttp.ClientSession, request: httpx.Request) -> httpx.Response:
    """Send `request` over `session`; return a buffered or streamed `httpx.Response`."""
    body = request.content if isinstance(request.stream, httpx.ByteStream) else None
    if body is None:
        body = await request.aread()
    try:
        response = await session.request(
            request.method,
            URL(str(request.url), encoded=True),
            headers=request.headers.multi_items(),
            data=body or None,
            timeout=_timeout(request),
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


def close_session_now(session: aiohttp.ClientSession) -> None:
    """Best-effort synchronous close, for a loop that can no longer run coroutines."""
    if session.closed:
        return
    connector = session.connector
    if connector is not None:
        # The loop is closed: the sockets die with the process if this fails.
        with contextlib.suppress(RuntimeError):
            connector._close()
    session._connector = None
