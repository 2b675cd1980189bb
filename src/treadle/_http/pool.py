"""`Pool`: keep-alive HTTP/1.1 connections of one event loop, for POSTs of one shape.

A completion request is the same POST again and again to one endpoint, so the request head is
encoded once per (URL, headers) and each request writes head and body in one `write`. Two calls:
`post` returns a whole `Reply`; `post_stream` returns a `StreamReply` once the head is in, whose
body must be closed. A connection goes back to the pool only when its reply was parsed to its end
(`treadle._http.protocol`); every other ending closes it. At most `max_connections` are open; a
request past that waits for one up to the pool timeout (`PoolTimeout`); at most
`max_idle_connections` wait idle, each for at most `keepalive_expiry` seconds (or 80% of the
server's own `Keep-Alive: timeout=`); past that cap a connection freed in a burst waits only
`SURPLUS_IDLE_SECONDS`, so requests that pause together (a conversation store's group commit)
reuse their connections instead of closing and opening hundreds; a connect that runs out of file
descriptors first closes that surplus (of any host) and tries again. Failures are
`treadle._http.errors`; nothing blocks the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from urllib.parse import quote, urlsplit

from treadle._http.connect import NetworkOptions, Route, open_connection, route_for
from treadle._http.errors import InvalidHeader, OpenFilesExhausted, PoolClosed, PoolTimeout
from treadle._http.protocol import Body, Connection, Exchange
from treadle._http.reply import Reply, StreamReply, Timeouts
from treadle.runtime import progress

__all__ = [
    "DEFAULT_KEEPALIVE_EXPIRY",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_IDLE_CONNECTIONS",
    "NetworkOptions",
    "Pool",
    "Route",
]

DEFAULT_MAX_CONNECTIONS = 1024
"""Open connections per pool: as many as requests the endpoint limiter lets through by default
(`Provider.max_concurrent_requests`), so a fan-out queues at the limiter, not here."""
DEFAULT_MAX_IDLE_CONNECTIONS = 128
"""Idle connections kept per pool after a burst; the rest are closed (file descriptors)."""
DEFAULT_KEEPALIVE_EXPIRY = 30.0
"""Seconds an idle connection is kept for reuse."""
SURPLUS_IDLE_SECONDS = 2.0
"""Seconds a connection freed while `max_idle_connections` already wait is kept before it is
closed. Closing it at once made every burst of requests that pause together (passes awaiting a
store's group commit, then all starting their next turn) open as many new connections: scenario
9 opened 4,846 instead of 1,000, about 0.1 ms of client CPU per turn."""
_SWEEP_GATHER = 0.05
"""Seconds a sweep waits past the first surplus deadline, so that one sweep closes the surplus
a burst freed within that time (instead of one sweep per connection)."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110 token)."""
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
"""Characters left as they are in a request path (anything else is percent-encoded)."""
_SKIPPED = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class _Target:
    """What every request to one URL with one set of headers needs: the route and the head."""

    __slots__ = ("headers", "idle", "prefix", "route", "url")

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        options: NetworkOptions,
        idle: dict[Route, list[Connection]],
    ) -> None:
        route = route_for(url, options)
        self.url, self.headers, self.route = url, headers, route
        self.idle = idle.setdefault(route, [])
        """The route's idle connections (looked up once: a route's hash is a Python call)."""
        parts = urlsplit(url)
        path = quote(parts.path or "/", safe=_PATH_SAFE)
        if parts.query:
            path = f"{path}?{quote(parts.query, safe=_PATH_SAFE + '?')}"
        if route.absolute_form:  # plain http through a proxy: the full URL is the target
            path = f"{route.scheme}://{route.authority}{path}"
        lines = [f"POST {path} HTTP/1.1", f"host: {route.authority}"]
        pairs = [*headers.items(), *route.proxy_headers] if route.absolute_form else headers.items()
        for name, value in pairs:
            if name.lower() in _SKIPPED:
                continue
            if not _TOKEN.fullmatch(name):
                raise InvalidHeader(f"The request header name {name!r} is not valid HTTP.", url=url)
            if any(c in value for c in "\r\n\0"):
                raise InvalidHeader(
                    f"The request header {name!r} holds a line break or NUL; check the API key "
                    "and the provider's extra headers.",
                    url=url,
                )
            lines.append(f"{name}: {value}")
        # Names are ASCII (checked above); values go as UTF-8, as aiohttp sent them.
        self.prefix = ("\r\n".join(lines) + "\r\ncontent-length: ").encode("utf-8")


class Pool:
    """Pooled keep-alive HTTP/1.1 connections of one event loop (see the module docstring)."""

    def __init__(
        self,
        *,
        max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
        max_idle_connections: int = DEFAULT_MAX_IDLE_CONNECTIONS,
        keepalive_expiry: float = DEFAULT_KEEPALIVE_EXPIRY,
        options: NetworkOptions | None = None,
    ) -> None:
        self._limit = max_connections or 0
        self._max_idle = max_idle_connections
        self._expiry = keepalive_expiry
        self._options = options if options is not None else NetworkOptions()
        self._idle: dict[Route, list[Connection]] = {}
        self._idle_count = 0
        self._open = 0
        self._all: set[Connection] = set()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._targets: dict[int, _Target] = {}
        self._sweep: asyncio.TimerHandle | None = None  # closes surplus idle connections
        self._sweep_at = 0.0  # when the scheduled sweep is due
        self._closing: set[Connection] = set()  # closed to free descriptors, sockets not yet
        self.closed = False

    @property
    def open_connections(self) -> int:
        """Connections open now (in use or idle)."""
        return self._open

    @property
    def idle_connections(self) -> int:
        """Connections waiting idle for reuse."""
        return self._idle_count

    # -- requests -------------------------------------------------------------------------------

    def _target(self, url: str, headers: dict[str, str]) -> _Target:
        target = self._targets.get(id(headers))
        if target is None or target.headers is not headers or target.url != url:
            if len(self._targets) > 256:
                self._targets.clear()
            target = self._targets[id(headers)] = _Target(url, headers, self._options, self._idle)
        return target

    async def _send(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts, stream: bool
    ) -> tuple[Connection, Exchange]:
        target = self._target(url, headers)
        conn = await self._acquire(target, timeouts)
        ex = conn.begin(url, stream=stream, read=timeouts.read)
        transport = conn.transport
        assert transport is not None
        transport.write(b"%b%d\r\n\r\n%b" % (target.prefix, len(body), body))  # one write
        try:
            await ex.head
        except BaseException:
            conn.close()  # a failed or cancelled request's reply is never read on
            raise
        return conn, ex

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> Reply:
        """POST `body` and read the whole reply (decompressed)."""
        conn, ex = await self._send(url, body, headers, timeouts, False)
        reply = Reply(ex.status, ex.headers, ex.content())
        self.release(conn, ex)
        return reply

    async def post_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
    ) -> StreamReply:
        """POST `body`; the status, headers and body stream once the reply's head arrived."""
        conn, ex = await self._send(url, body, headers, timeouts, True)
        return StreamReply(ex.status, ex.headers, Body(conn, ex, self.release))

    # -- the pool -------------------------------------------------------------------------------

    def _take_idle(self, idle: list[Connection], now: float) -> Connection | None:
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            conn.pooled = False
            transport = conn.transport
            if conn.closed or now > conn.idle_until or transport is None or transport.is_closing():
                conn.close()
                continue
            return conn
        return None

    async def _acquire(self, target: _Target, timeouts: Timeouts) -> Connection:
        if self.closed:
            raise PoolClosed("This connection pool is closed; create a new client.")
        loop = asyncio.get_running_loop()
        route, idle = target.route, target.idle
        conn = self._take_idle(idle, loop.time())
        if conn is not None:
            return conn
        if self._limit and self._open >= self._limit:
            try:
                async with asyncio.timeout(timeouts.pool):
                    while self._limit and self._open >= self._limit:
                        if self._evict_idle():
                            continue
                        await self._wait_for_room(loop)
                        conn = self._take_idle(idle, loop.time())
                        if conn is not None:
                            return conn
            except TimeoutError:
                raise PoolTimeout(
                    f"No connection to {route.scheme}://{route.authority} became free within "
                    f"{timeouts.pool:g} s ({self._open} open); raise pool_timeout, or close "
                    "streams you stop reading.",
                    url=f"{route.scheme}://{route.authority}",
                ) from None
        self._open += 1
        try:
            for tries in range(1, 4):
                try:
                    _, opened = await open_connection(
                        route,
                        lambda: Connection(self._lost, route, idle),
                        options=self._options,
                        connect_timeout=timeouts.connect,
                    )
                    break
                except OpenFilesExhausted:
                    # The surplus a burst left idle holds descriptors this connect needs: close
                    # it and try again (so does a connect that failed while another closed it).
                    if tries == 3 or not await self._free_descriptors():
                        raise
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        self._all.add(opened)
        return opened

    async def _free_descriptors(self) -> bool:
        """Close the surplus idle connections of every route and wait until their sockets are
        closed; whether any were (or were still closing): worth connecting again."""
        self._close_surplus(asyncio.get_running_loop().time())
        if not self._closing:
            return False
        for _ in range(100):  # a guard: aborted sockets close within a turn or two
            await asyncio.sleep(0)
            if not self._closing:
                break
        return True

    def _close_surplus(self, now: float) -> None:
        """Close at once the idle connections of any route that were kept only as a burst's
        surplus (due within `SURPLUS_IDLE_SECONDS`)."""
        for idle in self._idle.values():
            keep = []
            for conn in idle:
                if conn.idle_until <= now + SURPLUS_IDLE_SECONDS or conn.closed:
                    conn.pooled = False
                    if conn.transport is not None and not conn.closed:
                        self._closing.add(conn)  # until its socket is closed (`_lost`)
                        conn.transport.abort()  # at the next turn, with no TLS goodbye
                    conn.close()
                    self._forget(conn)
                else:
                    keep.append(conn)
            self._idle_count -= len(idle) - len(keep)
            idle[:] = keep

    async def _wait_for_room(self, loop: asyncio.AbstractEventLoop) -> None:
        waiter = loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._wake_one()  # pass the freed slot on
            else:
                waiter.cancel()
            raise

    def _evict_idle(self) -> bool:
        """Close one idle connection of any route to make room (True if there was one)."""
        for idle in self._idle.values():
            while idle:
                conn = idle.pop(0)
                self._idle_count -= 1
                conn.pooled = False
                if not conn.closed:
                    conn.close()
                    self._forget(conn)
                    return True
        return False

    def release(self, conn: Connection, ex: Exchange) -> None:
        """Pool `conn` after `ex`, its reply, was parsed to its end on a reusable connection;
        close it otherwise (never pooled twice)."""
        if conn.pooled:
            return
        progress.step()  # a reply ended: the start gate's stall check sees passes moving
        if (
            conn.closed
            or self.closed
            or not ex.complete
            or ex.error is not None
            or not ex.keep_alive
            or conn.exchange is not None
            or self._max_idle <= 0
        ):
            conn.close()
            return
        keep = self._expiry
        hint = dict.get(ex.headers, "keep-alive")
        if hint is not None:  # the server's own idle timeout: reuse well before it closes
            keep = min(keep, _server_idle_seconds(hint, keep))
        loop: asyncio.AbstractEventLoop | None = None
        if self._idle_count >= self._max_idle:  # a surplus: kept only through the burst
            keep = min(keep, SURPLUS_IDLE_SECONDS)
            if self._sweep is None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # no loop to close it later (shutting down): close now
                    conn.close()
                    return
        conn.reused = conn.pooled = True
        conn.idle_until = conn.now() + keep
        conn.idle.append(conn)
        self._idle_count += 1
        if loop is not None:  # timed from this connection's deadline, once it is set
            self._schedule_sweep(loop, conn.idle_until)
        self._wake_one()

    def _schedule_sweep(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        """Sweep once the idle connection due at `due` (the first one) has had its time."""
        self._sweep_at = due + _SWEEP_GATHER
        self._sweep = loop.call_at(self._sweep_at, self._close_expired)

    def _close_expired(self) -> None:
        """Close the idle connections whose time is up (the surplus of a burst); look again at
        the next one's deadline while more than `max_idle_connections` still wait."""
        self._sweep = None
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        now = max(loop.time(), self._sweep_at)  # a timer may fire a hair before it is due
        for idle in self._idle.values():
            keep = [conn for conn in idle if conn.idle_until > now and not conn.closed]
            for conn in idle:
                if conn.idle_until <= now or conn.closed:
                    conn.pooled = False
                    conn.close()
                    self._forget(conn)
            self._idle_count -= len(idle) - len(keep)
            idle[:] = keep
        if self._idle_count > self._max_idle:  # the rest of the surplus, at the next deadline
            due = min(conn.idle_until for idle in self._idle.values() for conn in idle)
            self._schedule_sweep(loop, due)

    def _lost(self, conn: Connection) -> None:
        progress.step()
        self._closing.discard(conn)
        if conn.pooled:
            if conn in conn.idle:
                conn.idle.remove(conn)
                self._idle_count -= 1
            conn.pooled = False
        self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        if conn in self._all:
            self._all.discard(conn)
            self._open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close every connection (idempotent; safe when the loop can no longer run).

        Requests waiting for a connection, and replies still arriving, fail with `PoolClosed`;
        none is cancelled (a task that was not cancelled never sees `CancelledError` from here).
        """
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._all):
            with contextlib.suppress(RuntimeError):  # a closed loop: sockets die with the process
                conn.close(by_client=True)
        for idle in self._idle.values():
            idle.clear()
        self._idle_count = 0
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(
                    PoolClosed("The client was closed while this request waited for a connection.")
                )

    async def aclose(self) -> None:
        """Close every connection and let the transports finish closing."""
        self.close()
        await asyncio.sleep(0)  # the transports close on the next turn (no unclosed warnings)


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
