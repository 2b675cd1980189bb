"""The fake server's HTTP/1.1 side: one `asyncio.Protocol` per connection, requests in order.

Parses keep-alive requests (Content-Length bodies only), hands each to the server's `_handle`
and writes whole responses; the next pipelined request is served once the current one finished.
No framework: the fake server must sustain thousands of concurrent passes on a small machine.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle.testing.fake_server import FakeOpenAIServer

__all__ = ["MAX_HEADER_BYTES", "Connection", "head"]

MAX_HEADER_BYTES = 64 * 1024
"""Requests whose head is larger than this are answered 431 and the connection closed."""

_REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
    429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
    504: "Gateway Timeout",
}  # fmt: skip


def head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
    lines.extend(f"{k}: {v}" for k, v in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connection(asyncio.Protocol):
    """One client connection: parses requests in order, answers each after its latency."""

    def __init__(self, server: FakeOpenAIServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False
        self.close_after = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server._connections.add(self)
        self.server.connections_opened += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.server._done_one()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next_request()

    def _write(self, data: bytes) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        transport.write(data)
        return True

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _next_request(self) -> None:
        buf = self.buffer
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEADER_BYTES:
                self._write(head(431, [("content-length", "0"), ("connection", "close")]))
                self._close()
            return
        lines = buf[:end].decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            self._close()
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            self._write(head(411, [("content-length", "0"), ("connection", "close")]))
            self._close()
            return
        length = int(headers.get("content-length") or 0)
        if len(buf) < end + 4 + length:
            return
        body = bytes(buf[end + 4 : end + 4 + length])
        del buf[: end + 4 + length]
        self.close_after = version == "HTTP/1.0" or headers.get("connection") == "close"
        self.busy = True
        self.server._handle(self, method, target, headers, body)

    def finish(self) -> None:
        """The current response is fully written: serve the next pipelined request, if any."""
        self.busy = False
        if self.close_after:
            self._close()
        elif self.buffer and self.transport is not None:
            self._next_request()

    def send(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        """Write a whole response with a Content-Length."""
        headers.append(("content-length", str(len(body))))
        self._write(head(status, headers) + body)
        self.finish()
