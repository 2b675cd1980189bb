"""A second reference for scenario 1: the hand loop over one raw asyncio connection and orjson.

Treadle posts completions over its own HTTP/1.1 lane, so the aiohttp+orjson floor is no longer
the least a Python loop can spend per round. This loop shows what is: one keep-alive socket,
one write per request, a reply read by Content-Length, no pool, no timeouts, no error handling
beyond "not 200". It serves the serial scenario only (no streaming, no fan-out).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import orjson

from benchmarks.reference import hand_loop
from benchmarks.reference.hand_loop import HandLoop
from benchmarks.worker import Meter
from benchmarks.workload import MODEL


class _Reply(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future[bytes] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in bytes(self.buf[:end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        if len(self.buf) >= end + 4 + length and self.waiter is not None:
            if not self.buf.startswith(b"HTTP/1.1 200"):
                self.waiter.set_exception(RuntimeError(bytes(self.buf[:40]).decode()))
            else:
                self.waiter.set_result(bytes(self.buf[end + 4 : end + 4 + length]))
            del self.buf[: end + 4 + length]
            self.waiter = None


class _Connection:
    """One keep-alive connection (an async context manager, like the other clients)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reply: _Reply | None = None

    async def __aenter__(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, self.reply = await loop.create_connection(_Reply, self.host, self.port)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.reply is not None and self.reply.transport is not None:
            self.reply.transport.close()

    async def post(self, head: bytes, body: bytes) -> bytes:
        reply = self.reply
        assert reply is not None and reply.transport is not None
        reply.waiter = asyncio.get_running_loop().create_future()
        reply.transport.write(b"%b%d\r\n\r\n%b" % (head, len(body), body))
        return await reply.waiter


class RawLoop(HandLoop):
    """The hand loop over `_Connection`, JSON through orjson."""

    dumps = staticmethod(orjson.dumps)
    loads = staticmethod(orjson.loads)

    def __init__(self, job: dict[str, Any], client: Any) -> None:
        super().__init__(job, client)
        parts = urlsplit(self.url)
        self.head = (
            f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"authorization: {self.headers['authorization']}\r\n"
            "content-type: application/json\r\ncontent-length: "
        ).encode()

    async def complete(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """POST the messages and return the assistant message."""
        body = orjson.dumps({"model": MODEL, "messages": messages, "tools": self.schemas})
        message: dict[str, Any] = orjson.loads(await self.client.post(self.head, body))
        return message["choices"][0]["message"]  # type: ignore[no-any-return]


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    return {"errors": hand_loop.serial(job, meter, lambda: _Connection(job["url"]), RawLoop)}
