"""`Lane`: Treadle's own HTTP/1.1 client for chat-completion POSTs, pooled per event loop.

A completion request is the same POST again and again to one endpoint, so the request head is
encoded once per (URL, headers) and each request writes head and body in one `write`. Replies
are read by `LaneProtocol` (`lane_wire`). The contract is `AiohttpTransport`'s fast path, which
delegates here: `post_buffered` returns `(status, headers, body)` and `post_stream` returns
`(status, headers, stream)` once the head is in, and failures are httpx's exception classes
(`ConnectError`, `ConnectTimeout`, `ReadTimeout`, `RemoteProtocolError`, `ReadError`), with
`StaleConnectionError` for a reused keep-alive connection the server closed before any byte of
the reply and `TLSMismatchError` for `https://` to a plain-HTTP port. A cancelled or abandoned
request's connection is closed, never pooled. At most `limit` connections are open; requests past
it wait for one (pool waits are not timed: a fan-out queues there by design).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
from collections import deque
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from multidict import CIMultiDict

from treadle.errors import ConfigurationError
from treadle.llm.http_errors import StaleConnectionError, TLSMismatchError, is_tls_mismatch
from treadle.llm.lane_wire import LaneProtocol, ReplyError

__all__ = ["Lane", "LaneBody"]

DNS_TTL_SECONDS = 300.0
"""How long a host's resolved addresses are reused for new connections."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110 token)."""
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
"""Characters left as they are in a request path (anything else is percent-encoded)."""
_R = TypeVar("_R")
_Key = tuple[str, str, int]
"""(scheme, host, port) of a pool."""


class _Target:
    """What every request to one URL with one set of headers needs: the pool key and the head."""

    __slots__ = ("headers", "key", "prefix", "url")

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(
                f"Request URL {url!r} is not an http:// or https:// URL.",
                request=httpx.Request("POST", url) if scheme in ("http", "https") else None,
            )
        port = parts.port or (443 if scheme == "https" else 80)
        host = parts.hostname
        if not host.isascii():  # an internationalised name: its ASCII (punycode) form
            host = host.encode("idna").decode("ascii")
        self.url = url
        self.headers = headers
        self.key: _Key = (scheme, host, port)
        authority = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            authority = f"{authority}:{parts.port}"
        path = quote(parts.path or "/", safe=_PATH_SAFE)
        if parts.query:
            path = f"{path}?{quote(parts.query, safe=_PATH_SAFE + '?')}"
        lines = [f"POST {path} HTTP/1.1", f"host: {authority}"]
        for name, value in headers.items():
            if name.lower() in ("host", "content-length", "transfer-encoding", "connection"):
                continue
            # Configuration mistakes, not network failures: raised as such, never retried.
            if not _TOKEN.fullmatch(name):
                raise ConfigurationError(f"The request header name {name!r} is not valid HTTP.")
            if any(c in value for c in "\r\n\0"):
                raise ConfigurationError(
                    f"The request header {name!r} holds a line break or NUL; check the API key "
                    "and the provider's extra headers."
                )
            lines.append(f"{name}: {value}")
        # Names are ASCII (checked above); values go as UTF-8, as aiohttp sent them.
        self.prefix = ("\r\n".join(lines) + "\r\ncontent-length: ").encode("utf-8")


class LaneBody:
    """A streamed reply's body: iterate for byte chunks; always `aclose()` it."""

    __slots__ = ("_lane", "_proto", "_released", "_url")

    def __init__(self, lane: Lane, proto: LaneProtocol, url: str) -> None:
        self._lane, self._proto, self._url = lane, proto, url
        self._released = False

    def __aiter__(self) -> LaneBody:
        return self

    async def __anext__(self) -> bytes:
        proto = self._proto
        try:
            data = await proto.next_chunk()
        except BaseException as exc:
            proto.close()
            raise _mapped(exc, self._url, proto, stream=True) from exc
        if not data:
            raise StopAsyncIteration
        return data

    async def aclose(self) -> None:
        """Return the connection to the pool if the body was read to its end, else close it.

        Idempotent: a second close must not pool the connection twice (two requests would then
        share it)."""
        if not self._released:
            self._released = True
            self._lane.release(self._proto)


class Lane:
    """Pooled keep-alive HTTP/1.1 connections of one event loop (see the module docstring)."""

    def __init__(self, *, limit: int | None, keepalive_timeout: float) -> None:
        self._limit = limit or 0
        self._keepalive = keepalive_timeout
        self._idle: dict[_Key, list[LaneProtocol]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._targets: dict[int, _Target] = {}
        self._dns: dict[tuple[str, int], tuple[float, list[Any]]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._all: set[LaneProtocol] = set()
        self.closed = False

    # -- requests -------------------------------------------------------------------------------

    def _target(self, url: str, headers: dict[str, str]) -> _Target:
        target = self._targets.get(id(headers))
        if target is None or target.headers is not headers or target.url != url:
            if len(self._targets) > 256:
                self._targets.clear()
            target = self._targets[id(headers)] = _Target(url, headers)
        return target

    async def _request(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: httpx.Timeout, stream: bool
    ) -> LaneProtocol:
        target = self._target(url, headers)
        proto = await self._acquire(target, timeouts.connect)
        proto.begin(stream=stream)
        transport = proto.transport
        assert transport is not None
        transport.write(b"%b%d\r\n\r\n%b" % (target.prefix, len(body), body))
        if timeouts.read is not None:
            proto.arm(timeouts.read)
        return proto

    async def post_buffered(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: httpx.Timeout
    ) -> tuple[int, CIMultiDict[str], bytes]:
        """POST `body` and read the whole reply: `(status, headers, content)`, decompressed."""
        proto = await self._request(url, body, headers, timeouts, False)
        assert proto.whole is not None
        head, content = await _reply(proto, proto.whole, url)
        self.release(proto)
        return head.status, head.headers, content

    async def post_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: httpx.Timeout
    ) -> tuple[int, CIMultiDict[str], LaneBody]:
        """POST `body`; `(status, headers, body stream)` once the reply's head arrived."""
        proto = await self._request(url, body, headers, timeouts, True)
        assert proto.head is not None
        head = await _reply(proto, proto.head, url)
        return head.status, head.headers, LaneBody(self, proto, url)

    # -- the pool -------------------------------------------------------------------------------

    async def _acquire(self, target: _Target, connect_timeout: float | None) -> LaneProtocol:
        if self.closed:
            raise RuntimeError("This connection pool is closed; create a new client.")
        idle = self._idle.get(target.key)
        loop = asyncio.get_running_loop()
        while idle:
            proto = idle.pop()
            proto.pooled = False
            if proto.closed or loop.time() > proto.idle_until:
                proto.close()
                continue
            return proto
        while self._limit and self._open >= self._limit:
            if self._evict_idle():
                continue
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # pass the freed slot on
                else:
                    waiter.cancel()
                raise
            idle = self._idle.get(target.key)
            while idle:
                proto = idle.pop()
                proto.pooled = False
                if not proto.closed:
                    return proto
        self._open += 1
        try:
            return await self._connect(target, connect_timeout)
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    def _evict_idle(self) -> bool:
        """Close one idle connection of any endpoint to make room (True if there was one)."""
        for idle in self._idle.values():
            while idle:
                proto = idle.pop(0)
                proto.pooled = False
                if not proto.closed:
                    proto.close()
                    self._forget(proto)
                    return True
        return False

    def release(self, proto: LaneProtocol) -> None:
        """Back to the pool after a complete reply on a reusable connection, else closed."""
        if proto.pooled:
            return  # already idle: pooling it twice would hand it to two requests
        reply = proto.reply
        if (
            proto.closed
            or self.closed
            or not proto.complete
            or proto.error is not None
            or reply is None
            or not reply.keep_alive
        ):
            proto.close()
            return
        proto.used = proto.pooled = True
        keep = self._keepalive
        hint = reply.headers.get("keep-alive")
        if hint is not None:  # the server's own idle timeout: reuse well before it closes
            keep = min(keep, _server_idle_seconds(hint, keep))
        proto.idle_until = asyncio.get_running_loop().time() + keep
        self._idle.setdefault(proto.key, []).append(proto)
        self._wake_one()

    def _lost(self, proto: LaneProtocol) -> None:
        if proto in self._all:
            self._forget(proto)

    def _forget(self, proto: LaneProtocol) -> None:
        if proto in self._all:
            self._all.discard(proto)
            self._open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self, target: _Target, connect: float | None) -> LaneProtocol:
        scheme, host, port = target.key
        loop = asyncio.get_running_loop()
        context = self._context() if scheme == "https" else None
        try:
            async with asyncio.timeout(connect):
                addresses = await self._resolve(host, port)
                last: BaseException | None = None
                for family, _, proto_num, _, address in addresses:
                    try:
                        _, proto = await loop.create_connection(
                            lambda: LaneProtocol(self._lost),
                            address[0],
                            address[1],
                            family=family,
                            proto=proto_num,
                            ssl=context,
                            server_hostname=host if context is not None else None,
                            ssl_handshake_timeout=(connect / 2 if connect else None)
                            if context is not None
                            else None,
                        )
                        break
                    except OSError as exc:
                        last = exc
                else:
                    raise last or OSError(f"cannot resolve {host!r}")
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                f"Connecting to {host}:{port} timed out", request=httpx.Request("POST", target.url)
            ) from exc
        except (OSError, ssl.SSLError) as exc:
            request = httpx.Request("POST", target.url)
            message = f"Cannot connect to {host}:{port}: {exc}"
            if context is not None and is_tls_mismatch(exc):
                raise TLSMismatchError(message, request=request) from exc
            raise httpx.ConnectError(message, request=request) from exc
        proto.key = target.key
        self._all.add(proto)
        return proto

    async def _resolve(self, host: str, port: int) -> list[Any]:
        loop = asyncio.get_running_loop()
        cached = self._dns.get((host, port))
        if cached is not None and cached[0] > loop.time():
            return cached[1]
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        self._dns[(host, port)] = (loop.time() + DNS_TTL_SECONDS, infos)
        return infos

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def close(self) -> None:
        """Close every connection (idempotent; safe when the loop can no longer run)."""
        self.closed = True
        for proto in list(self._all):
            with contextlib.suppress(RuntimeError):  # a closed loop: sockets die with the process
                proto.close()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()


def _server_idle_seconds(hint: str, default: float) -> float:
    """80% of the `timeout=N` a `Keep-Alive` header gives (`default` when it gives none): a
    connection reused just as the server closes it is a request lost on the way."""
    for part in hint.split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "timeout":
            try:
                return max(0.0, float(value.strip()) * 0.8)
            except ValueError:
                return default
    return default


async def _reply(proto: LaneProtocol, future: asyncio.Future[_R], url: str) -> _R:
    """`await future`; on any failure the connection is dropped and the error mapped."""
    try:
        return await future
    except BaseException as exc:
        proto.close()
        raise _mapped(exc, url, proto) from exc


def _mapped(
    exc: BaseException, url: str, proto: LaneProtocol, *, stream: bool = False
) -> BaseException:
    """httpx's exception for a failed reply (`exc` itself when it is not a network failure)."""
    if isinstance(exc, httpx.HTTPError) or not isinstance(exc, Exception):
        return exc  # cancellation and interrupts pass through as they are
    request = httpx.Request("POST", url)
    message = str(exc) or type(exc).__name__
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, ReplyError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, OSError):
        if not proto.got_bytes and not stream:
            if proto.used:
                return StaleConnectionError(message, request=request)
            return httpx.RemoteProtocolError(f"Server disconnected ({message})", request=request)
        if isinstance(exc, ConnectionResetError | BrokenPipeError):
            return httpx.ReadError(message, request=request)
        return httpx.RemoteProtocolError(f"Server disconnected ({message})", request=request)
    return exc
