"""One HTTP/1.1 connection: an `asyncio.Protocol` feeding reply bytes to llhttp (`httptools`).

The parser is llhttp's (the one under uvicorn and Node): it frames heads, lengths and chunks and
refuses what every trusted client refuses. The flow control is ours: one `Exchange` per request
holds that reply's head, body and error, so nothing of one reply can reach another; reading
pauses while a streamed body waits for its reader; a read timer fails a silent reply; sizes are
bounded before the bytes are kept (heads, 1xx runs, trailers, decompressed bodies). A connection
is reusable only when its exchange ended complete, on a keep-alive reply, with no byte past it.
Nothing here blocks or sleeps; errors are `treadle._http.errors` values set on the exchange.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httptools

from treadle._http.errors import (
    BodyClosed,
    DecodeError,
    HTTPError,
    MalformedReply,
    PoolClosed,
    ReadTimeout,
    RemoteProtocolError,
    StaleConnection,
    UnsupportedReply,
)
from treadle._http.read_buffer import thread_read_buffer
from treadle._http.reply import UPGRADE, Headers, decoder, headers_of, unsupported

if TYPE_CHECKING:
    from treadle._http.pool import Route

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_HEAD_BYTES",
    "MAX_INTERIM_REPLIES",
    "MAX_TRAILER_BYTES",
    "STALE_WINDOW_SECONDS",
    "Body",
    "Connection",
    "Exchange",
]

MAX_HEAD_BYTES = 64 * 1024
"""A status line and headers longer than this are refused (also: this many bytes with no
progress of the parser, such as one endless header line)."""
MAX_INTERIM_REPLIES = 32
"""`1xx` interim heads accepted before the final reply; a server sending more is refused."""
MAX_TRAILER_BYTES = 16 * 1024
"""Trailer fields after a chunked body beyond this are refused (trailers are read, not kept)."""
MAX_BODY_BYTES = 256 * 1024 * 1024
"""A (decompressed) reply body larger than this is refused rather than held in memory."""
PAUSE_BYTES = 1024 * 1024
"""A streamed body buffered past this pauses reading until its reader catches up."""
# A lost connection's: its own parser's callbacks are a cycle keeping it alive (issue 33).
_SPENT_PARSER, _SPENT_BUFFER = httptools.HttpResponseParser(object()), memoryview(bytearray(0))
STALE_WINDOW_SECONDS = 0.005
"""A reused connection closed with no reply byte within 5 ms of the write was closed while idle
(the server never saw the request): re-sent without counting a retry, never with `max_retries=0`.
Milliseconds only: a server that worked on it for 20 ms before closing may have billed it."""


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing with `error`."""

    def __init__(self, error: HTTPError) -> None:
        super().__init__(str(error))
        self.error = error


class Exchange:
    """One request's reply: filled by the connection, read by the pool or a `Body`."""

    __slots__ = ("complete", "decoder", "error", "got_bytes", "head", "headers", "keep_alive",
                 "parts", "queue", "queued", "size", "status", "stream", "url", "waiter",
                 "whole")  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, url: str, *, stream: bool) -> None:
        self.url = url
        self.stream = stream
        self.head: asyncio.Future[None] = loop.create_future()
        """Resolved once the final head is in (streamed), or the whole reply (buffered)."""
        self.whole = not stream
        self.status = 0
        self.headers = Headers()
        self.keep_alive = False
        self.complete = False
        """True once the reply was parsed to its end."""
        self.error: HTTPError | None = None
        self.got_bytes = False
        self.decoder: Any = None
        self.size = 0
        self.parts: list[bytes] = []
        self.queue: deque[bytes] = deque()
        self.queued = 0
        self.waiter: asyncio.Future[None] | None = None

    def deliver(self, data: bytes) -> None:
        """Body bytes as they came off the wire: decompressed, bounded, kept or queued."""
        if self.decoder is not None:
            try:
                data = self.decoder.decompress(data)
            except zlib.error as exc:
                raise _Refused(DecodeError(f"The compressed reply is corrupt ({exc}).")) from None
        if not data:
            return
        self.size += len(data)
        if self.size > MAX_BODY_BYTES:
            raise _Refused(DecodeError(f"The reply body is over {MAX_BODY_BYTES} bytes."))
        if self.whole:
            self.parts.append(data)
        else:
            self.queue.append(data)
            self.queued += len(data)

    def finish(self) -> None:
        """The body ended: flush the decompressor and mark the reply complete."""
        if self.decoder is not None:
            tail = self.decoder.flush()
            self.decoder = None
            if tail:
                self.deliver(tail)
        self.complete = True

    def content(self) -> bytes:
        """A buffered reply's whole body."""
        parts = self.parts
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def fail(self, error: HTTPError) -> None:
        """End this reply with `error` (the first error wins)."""
        if self.error is None:
            self.complete = False
            self.error = error
        self.settle()

    def settle(self) -> None:
        """Wake whoever waits: the head (or whole) future, a body reader."""
        head = self.head
        if not head.done():
            if self.error is not None:
                head.set_exception(self.error)
                head.exception()  # retrieved: its waiter may have been cancelled already
            elif self.complete or (self.stream and self.status):
                head.set_result(None)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Connection(asyncio.BufferedProtocol):
    """One kept-alive connection carrying one exchange at a time (see the module docstring)."""

    def __init__(
        self, on_lost: Callable[[Connection], None], key: Route, idle: list[Connection]
    ) -> None:
        self.key = key
        """The pool's key (the route) this connection belongs to."""
        self.idle = idle
        """Where the pool keeps this route's idle connections."""
        self._on_lost = on_lost
        self._parser = httptools.HttpResponseParser(self)
        self._parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.reused = False
        """True once a reply was read whole on this connection."""
        self.pooled = False
        self.idle_until = 0.0
        self.written_at = 0.0
        self.last_data = 0.0
        self._read: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._quiet = 0  # bytes fed since the parser last made progress
        self._lenient = True
        self._trailer_size = 0
        self._by_client = False
        self._head_size = 0  # the current head's status and header bytes, across reads
        self._interim = 0
        self._in_head = True
        self._raw: list[tuple[bytes, bytes]] = []
        self._until_close = False
        self._buffer = thread_read_buffer()  # shared by this loop's connections (read_buffer)

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._loop = asyncio.get_running_loop()

    def now(self) -> float:
        """The loop's clock."""
        assert self._loop is not None
        return self._loop.time()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._buffer[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        """Feed one read to the parser (llhttp copies what it hands on: `data` may be reused)."""
        ex = self.exchange
        if ex is None:
            # Bytes with no request outstanding: this connection is out of step with its
            # server. A lone CRLF after a reply is harmless, but the connection is not reused.
            self.close()
            return
        assert self._loop is not None
        self.last_data = self._loop.time()
        ex.got_bytes = True
        self._quiet += len(data)
        error: HTTPError | None = None
        try:
            self._parser.feed_data(data)
        except _Refused as exc:
            error = exc.error
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            error = cause.error if isinstance(cause, _Refused) else MalformedReply(str(exc))
        except httptools.HttpParserError as exc:
            error = MalformedReply(f"The reply is not valid HTTP/1.1 ({exc}).")
        except httptools.HttpParserUpgrade:  # an Exception, not an HttpParserError
            error = UnsupportedReply(UPGRADE)
        else:
            if self._quiet > MAX_HEAD_BYTES:
                where = "head" if self._in_head else "chunk framing or trailers"
                error = MalformedReply(f"The reply's {where} is over {MAX_HEAD_BYTES} bytes.")
        if error is not None and ex.complete and ex.error is None:
            # Junk after a finished reply (a stray byte, a 204's body): return it, never re-send.
            self.exchange = None
            ex.keep_alive = False
            self._disarm()
            self.close()
            ex.settle()
            return
        if error is not None:
            error.url = ex.url
            self.exchange = None
            ex.fail(error)
            self.close()
            return
        if ex.complete:
            # Nothing of a later read can reach this exchange. The read timer stays armed for
            # the next request on this connection (`begin`); firing while idle, it ends.
            self.exchange = None
        elif ex.queued >= PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        ex.settle()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost settles the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        ex, self.exchange = self.exchange, None
        if ex is not None and not ex.complete and ex.error is None:
            if exc is None and self._until_close and not self._in_head:
                try:
                    ex.finish()
                except _Refused as refused:
                    ex.fail(refused.error)
                ex.settle()
            else:
                ex.fail(self._lost(ex, exc))
        self._on_lost(self)
        self._parser, self._buffer = _SPENT_PARSER, _SPENT_BUFFER  # freed without the collector

    # -- llhttp's callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        ex = self.exchange
        if ex is None or ex.complete:
            raise _Refused(MalformedReply("The server sent bytes past the reply's end."))
        self._in_head = True
        self._trailer_size = 0
        self._head_size = 0
        self._raw = []
        if not self._lenient:
            self._lenient = True
            self._parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)

    def on_status(self, reason: bytes) -> None:
        self._grow_head(len(reason))  # the reason phrase, perhaps in pieces

    def _grow_head(self, size: int) -> None:
        # Counted here, not only by `_quiet`: a head split over reads ends (resetting `_quiet`)
        # before the check after a read would see its whole size.
        self._head_size += size
        if self._head_size > MAX_HEAD_BYTES:
            raise _Refused(MalformedReply(f"The reply's head is over {MAX_HEAD_BYTES} bytes."))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:
            self._grow_head(len(name) + len(value) + 4)
            self._raw.append((name, value))
            return
        self._trailer_size += len(name) + len(value) + 4  # a trailer: bounded, never kept
        if self._trailer_size > MAX_TRAILER_BYTES:
            raise _Refused(
                MalformedReply(f"The reply's trailers are over {MAX_TRAILER_BYTES} bytes.")
            )

    def on_headers_complete(self) -> None:
        parser = self._parser
        # Bare-LF line endings are read in the head, as httpx and aiohttp do; never in the body's
        # chunk framing, where a lenient reading could take a chunk's data for its size line.
        self._lenient = False
        parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=False)
        self._in_head = False
        self._quiet = 0
        status = parser.get_status_code()
        if (problem := unsupported(status, None)) is not None:  # before a 1xx is skipped
            raise _Refused(problem)
        if status < 200:
            self._interim += 1
            if self._interim > MAX_INTERIM_REPLIES:
                raise _Refused(
                    MalformedReply(f"The server sent over {MAX_INTERIM_REPLIES} 1xx replies.")
                )
            return
        ex = self.exchange
        assert ex is not None
        raw = self._raw
        self._raw = []
        headers = ex.headers = headers_of(raw)
        ex.status = status
        ex.keep_alive = parser.should_keep_alive()
        get = headers.get
        length = get("content-length")
        if length is not None and int(length) > MAX_BODY_BYTES:  # llhttp checked it is digits
            raise _Refused(
                DecodeError(f"The reply body ({length} bytes) is over {MAX_BODY_BYTES}.")
            )
        coding = get("transfer-encoding")
        if (problem := unsupported(status, coding)) is not None:
            raise _Refused(problem)
        self._until_close = status not in (204, 304) and length is None and coding is None
        coding = get("content-encoding")
        if coding is not None:
            try:
                ex.decoder = decoder(coding, ex.url)
            except DecodeError as exc:
                raise _Refused(exc) from None

    def on_body(self, data: bytes) -> None:
        self._quiet = 0
        ex = self.exchange
        assert ex is not None
        ex.deliver(data)

    def on_message_complete(self) -> None:
        self._quiet = 0
        ex = self.exchange
        assert ex is not None
        if ex.status == 0:  # the end of a 1xx interim reply: the final one follows
            return
        ex.finish()

    # -- the current request ------------------------------------------------------------------

    def begin(self, url: str, *, stream: bool, read: float | None) -> Exchange:
        """The exchange the next reply fills, its read timer armed; the caller then writes the
        request (one write, straight after: nothing can arrive in between)."""
        loop = self._loop
        assert loop is not None
        ex = self.exchange = Exchange(loop, url, stream=stream)
        self._interim = 0
        self.pooled = False
        now = self.written_at = self.last_data = loop.time()
        self._read = read
        timer = self._timer
        if read is None:
            if timer is not None:
                self._disarm()
        elif timer is None or timer.when() > now + read:
            # One timer is kept from reply to reply (`_check` re-arms from `last_data`); armed
            # anew only when there is none, or the kept one is due later than this read allows.
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(now + read, self._check)
        return ex

    def _lost(self, ex: Exchange, exc: Exception | None) -> HTTPError:
        """The error for a connection closed under an unfinished reply."""
        detail = f" ({exc})" if exc is not None else ""
        if self._by_client:
            return PoolClosed("The client was closed while this reply was arriving.", url=ex.url)
        if not ex.got_bytes:
            assert self._loop is not None
            if self.reused and self._loop.time() - self.written_at <= STALE_WINDOW_SECONDS:
                return StaleConnection(
                    f"The server had closed the kept-alive connection{detail}.", url=ex.url
                )
            return RemoteProtocolError(
                f"The server closed the connection without replying{detail}.", url=ex.url
            )
        return RemoteProtocolError(
            f"The server closed the connection mid-reply{detail}.", url=ex.url
        )

    def _check(self) -> None:
        self._timer = None
        ex, loop, read = self.exchange, self._loop, self._read
        if ex is None or self.closed or loop is None or read is None:
            return
        now = loop.time()
        due = now + read if self._paused else self.last_data + read
        if now < due:
            self._timer = loop.call_at(due, self._check)
            return
        self.exchange = None
        ex.fail(ReadTimeout(f"No byte of the reply came for {read:g} s.", url=ex.url))
        self.close()

    def _disarm(self) -> None:
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()

    def taken(self, ex: Exchange) -> None:
        """A reader took bytes from `ex`'s queue: resume reading once it has room."""
        if self._paused and ex.queued < PAUSE_BYTES and self.transport is not None:
            self._paused = False
            assert self._loop is not None
            self.last_data = self._loop.time()  # the silence while paused was the reader's
            self.transport.resume_reading()

    def close(self, *, by_client: bool = False) -> None:
        """Close the connection (idempotent); an unfinished exchange fails when it is lost."""
        self._by_client = self._by_client or by_client  # the pool closed: say so, not "server"
        self.closed = True
        self._disarm()  # now: a TLS close can hold `connection_lost` back for 30 s
        if self.transport is not None:
            self.transport.close()


class Body:
    """A streamed reply's body (`treadle._http.reply.BodyStream`): its own exchange's bytes only.

    `release` (the pool's) is called once, by `aclose`: it pools the connection only if the
    reply was parsed to its end, else closes it.
    """

    __slots__ = ("_closed", "_conn", "_ex", "_release")

    def __init__(
        self, conn: Connection, ex: Exchange, release: Callable[[Connection, Exchange], None]
    ) -> None:
        self._conn, self._ex, self._release = conn, ex, release
        self._closed = False

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise BodyClosed("The reply body was read after it was closed.", url=self._ex.url)
        ex = self._ex
        while True:
            if ex.queue:
                data = ex.queue.popleft()
                ex.queued -= len(data)
                self._conn.taken(ex)
                return data
            if ex.error is not None:
                raise ex.error
            if ex.complete:
                raise StopAsyncIteration
            waiter = ex.waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            except BaseException:
                self._closed = True
                self._conn.close()  # a cancelled reader leaves the rest unread
                raise
            finally:
                ex.waiter = None

    async def aclose(self) -> None:
        """Pool the connection if the reply was read to its end, else close it (idempotent)."""
        if not self._closed:
            self._closed = True
            self._release(self._conn, self._ex)
        elif not self._ex.complete:
            self._conn.close()
