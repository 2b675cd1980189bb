"""The lane's HTTP/1.1 response side: one `asyncio.Protocol` per connection, parsing as bytes come.

Why not aiohttp here: a chat completion is one POST and one reply, and aiohttp's client spends
about 130 µs of CPU per request on machinery a completion never uses (tracing hooks, cookie
filtering, a request and a response object with their timers, URL objects). This protocol parses
the status line and headers once they are all in, then frames the body by `Content-Length`,
`chunked` or the end of the connection, and hands it over whole (`whole` future) or chunk by chunk
(`next_chunk`). Malformed replies, oversized heads and torn bodies are failures with a message;
nothing is guessed. Errors are set as plain exceptions; `treadle.llm.lane` turns them into the
httpx classes the rest of `llm` classifies.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

from multidict import CIMultiDict

__all__ = ["MAX_BODY_BYTES", "MAX_HEAD_BYTES", "LaneProtocol", "ReplyError", "ReplyHead"]

MAX_HEAD_BYTES = 64 * 1024
"""A status line and headers longer than this are refused (a server that never ends its head)."""
MAX_BODY_BYTES = 256 * 1024 * 1024
"""A reply body larger than this is refused rather than held in memory."""
_PAUSE_BYTES = 1024 * 1024
"""A streamed body buffered past this pauses reading until the reader catches up."""

_LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = 1, 2, 3, 4


class ReplyError(Exception):
    """The reply broke HTTP/1.1 or ended early (`treadle.llm.lane` raises it as httpx's
    `RemoteProtocolError`)."""


class ReplyHead:
    """A reply's status, headers (case-insensitive) and whether the connection may be reused."""

    __slots__ = ("headers", "keep_alive", "status")

    def __init__(self, status: int, headers: CIMultiDict[str], keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive


def _parse_head(raw: bytes) -> tuple[ReplyHead, int, int | None]:
    """(head, framing, length) of a status line and headers (without the blank line)."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise ReplyError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    pairs = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name[-1] in " \t" or name[0] in " \t":
            raise ReplyError(f"malformed header line: {line[:80]!r}")
        pairs.append((name, value.strip()))
    headers: CIMultiDict[str] = CIMultiDict(pairs)
    status = int(code)
    keep_alive = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    coding = headers.get("transfer-encoding")
    lengths = headers.getall("content-length", [])
    if status < 200 or status in (204, 304):
        return ReplyHead(status, headers, keep_alive), _DONE, 0
    if coding is not None:
        if coding.strip().lower() != "chunked":
            raise ReplyError(f"unsupported transfer-encoding: {coding!r}")
        return ReplyHead(status, headers, keep_alive), _CHUNKED, None
    if lengths:
        if len(set(lengths)) != 1 or not lengths[0].strip().isdigit():
            raise ReplyError(f"invalid content-length: {lengths!r}")
        length = int(lengths[0])
        if length > MAX_BODY_BYTES:
            raise ReplyError(f"the reply body ({length} bytes) is over {MAX_BODY_BYTES} bytes")
        return ReplyHead(status, headers, keep_alive), _LENGTH, length
    return ReplyHead(status, headers, False), _UNTIL_CLOSE, None


def _decoder(headers: CIMultiDict[str]) -> Any:
    """A zlib decompressor for the reply's content-encoding (None: identity)."""
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding in ("identity", ""):
        return None
    if coding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if coding == "deflate":
        return zlib.decompressobj()
    raise ReplyError(f"unsupported content-encoding {coding!r} (Treadle offers gzip, deflate)")


class LaneProtocol(asyncio.Protocol):
    """One kept-alive connection; one request at a time (`begin`, then read the reply).

    `whole` (buffered mode) resolves to `(head, body)` once the body is complete; in streamed
    mode `head` resolves first and `next_chunk()` yields body bytes (b"" at the end).
    """

    def __init__(self, on_lost: Callable[[LaneProtocol], None]) -> None:
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.closed = False
        """True once the connection is gone (or is going)."""
        self.used = False
        """True once a reply was read on this connection (a later request reuses it)."""
        self.idle_until = 0.0
        """Loop time after which the idle connection is not reused."""
        self.pooled = False
        """True while the connection waits in the pool (never pooled twice)."""
        self.got_bytes = False
        """True once any byte of the current reply arrived."""
        self.last_data = 0.0
        self.complete = False
        """True once the current reply's body was read to its end."""
        self.head: asyncio.Future[ReplyHead] | None = None
        self.whole: asyncio.Future[tuple[ReplyHead, bytes]] | None = None
        self.reply: ReplyHead | None = None
        self.error: BaseException | None = None
        self._buf = bytearray()
        self._framing = 0
        self._left = 0  # bytes left of a Content-Length body or of the current chunk
        self._chunk_state = 0  # 0: size line, 1: data, 2: CRLF after data, 3: trailers
        self._parts: list[bytes] = []
        self._size = 0
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._waiter: asyncio.Future[None] | None = None
        self._decode: Any = None
        self._paused = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._read = 0.0
        self.key: Any = None
        """The pool this connection belongs to (set by the lane)."""

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._loop is not None:
            self.last_data = self._loop.time()
        try:
            if self._framing == 0:
                self._head_bytes(data)
            elif self._framing == _LENGTH and not self._buf:
                self._length_bytes(data)
            else:
                self._buf += data
                self._body()
        except ReplyError as exc:
            self.fail(exc)

    def eof_received(self) -> bool | None:
        if self._framing == _UNTIL_CLOSE:
            self._finish()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._framing == _UNTIL_CLOSE and exc is None:
            self._finish()
        active = self.head is not None or self.whole is not None
        if self.error is None and active and not self.complete:
            self._set_error(exc or ConnectionError("the server closed the connection"))
        self._on_lost(self)

    # -- the current request ------------------------------------------------------------------

    def begin(self, *, stream: bool) -> None:
        """Prepare for the next reply (streamed: `head` then chunks; else `whole`)."""
        loop = self._loop
        assert loop is not None
        self.got_bytes = self.complete = False
        self.reply = self.error = None
        self._framing = self._size = self._queued = 0
        self._parts = []
        self._decode = None
        self.last_data = loop.time()
        if stream:
            self.head, self.whole = loop.create_future(), None
        else:
            self.head, self.whole = None, loop.create_future()

    def fail(self, exc: BaseException) -> None:
        """End the current reply with `exc` and drop the connection."""
        self._set_error(exc)
        self.close()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def next_chunk(self) -> bytes:
        """The next piece of a streamed body (b"" once it ended); raises the reply's error."""
        while True:
            if self._queue:
                data = self._queue.popleft()
                self._queued -= len(data)
                if self._paused and self._queued < _PAUSE_BYTES and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            assert self._loop is not None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def arm(self, read: float) -> None:
        """Fail the current reply if no byte of it arrives for `read` seconds at a time (a
        reader too slow to take the bytes does not count: reading is paused then)."""
        assert self._loop is not None
        self._read = read
        self._timer = self._loop.call_at(self.last_data + read, self._check)

    def _check(self) -> None:
        self._timer = None
        loop = self._loop
        if self.complete or self.error is not None or self.closed or loop is None:
            return
        now = loop.time()
        due = now + self._read if self._paused else self.last_data + self._read
        if now < due:
            self._timer = loop.call_at(due, self._check)
            return
        self.fail(TimeoutError(f"no byte of the reply for {self._read:g} s"))

    def _disarm(self) -> None:
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()

    # -- parsing --------------------------------------------------------------------------------

    def _head_bytes(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                raise ReplyError(f"the reply's head is over {MAX_HEAD_BYTES} bytes")
            return
        head, framing, length = _parse_head(bytes(buf[:end]))
        rest = bytes(buf[end + 4 :])
        buf.clear()
        if head.status < 200:  # 1xx: an interim reply; the real one follows
            if rest:
                self._head_bytes(rest)
            return
        self.reply = head
        self._decode = _decoder(head.headers)
        self._framing = framing
        if self.head is not None:
            self.head.set_result(head)
        if framing == _DONE:
            self._finish()
        elif framing == _LENGTH:
            self._left = length or 0
            if self._left == 0:
                self._finish()
            elif rest:
                self._length_bytes(rest)
        else:
            self._chunk_state = 0
            if rest:
                self._buf += rest
                self._body()

    def _length_bytes(self, data: bytes) -> None:
        left = self._left
        if len(data) >= left:
            if len(data) > left:
                raise ReplyError("the server sent bytes past the reply's content-length")
            self._left = 0
            self._deliver(data)
            self._finish()
        else:
            self._left = left - len(data)
            self._deliver(data)

    def _body(self) -> None:
        buf = self._buf
        if self._framing == _UNTIL_CLOSE:
            data = bytes(buf)
            buf.clear()
            self._deliver(data)
            return
        while buf and self._framing == _CHUNKED:
            state = self._chunk_state
            if state == 0 or state == 3:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise ReplyError("a chunk-size line is too long")
                    return
                line = bytes(buf[:end])
                del buf[: end + 2]
                if state == 3:  # trailers end at an empty line
                    if not line:
                        self._finish()
                    continue
                size_text = line.split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ReplyError(f"bad chunk size {line[:40]!r}") from None
                if size == 0:
                    self._chunk_state = 3
                else:
                    self._left, self._chunk_state = size, 1
            elif state == 1:
                take = min(self._left, len(buf))
                data = bytes(buf[:take])
                del buf[:take]
                self._left -= take
                if self._left == 0:
                    self._chunk_state = 2
                self._deliver(data)
            else:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ReplyError("a chunk is not followed by CRLF")
                del buf[:2]
                self._chunk_state = 0
        if self._framing == _DONE and buf:
            raise ReplyError("the server sent bytes past the reply's end")

    def _deliver(self, data: bytes) -> None:
        if self._decode is not None:
            try:
                data = self._decode.decompress(data)
            except zlib.error as exc:
                raise ReplyError(f"the compressed body is corrupt ({exc})") from None
        if not data:
            return
        self._size += len(data)
        if self._size > MAX_BODY_BYTES:
            raise ReplyError(f"the reply body is over {MAX_BODY_BYTES} bytes")
        if self.whole is not None:
            self._parts.append(data)
            return
        self._queue.append(data)
        self._queued += len(data)
        if self._queued >= _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        if self.complete:
            return
        if self._decode is not None:
            tail = self._decode.flush()
            self._decode = None
            if tail:
                self._deliver(tail)
        self.complete = True
        self._framing = _DONE
        self._disarm()
        if self.whole is not None and not self.whole.done() and self.reply is not None:
            parts = self._parts
            self.whole.set_result((self.reply, parts[0] if len(parts) == 1 else b"".join(parts)))
            self._parts = []
        self._wake()

    def _set_error(self, exc: BaseException) -> None:
        if self.error is not None or self.complete:
            return
        self.error = exc
        self._disarm()
        for future in (self.head, self.whole):
            if future is not None and not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: the waiter may have been cancelled already
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
