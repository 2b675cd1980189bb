"""Servers, a black hole and a client protocol for the tests of `treadle._http.connect`.

Everything listens on 127.0.0.x; `tcp_server` ends every connection it accepted when its block
ends (Python 3.11's `Server.close()` leaves them open).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from treadle._http.connect import (
    Address,
    NetworkOptions,
    Resolver,
    Route,
    open_connection,
)

ROOT = Path(__file__).resolve().parent.parent
NO_ENV = NetworkOptions(trust_env=False)


class Collect(asyncio.Protocol):
    """Records what the connection delivers; `closed` resolves when it ends."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.made = 0
        self.transport: asyncio.BaseTransport | None = None
        self.closed: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._arrived = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made += 1
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        self._arrived.set()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        self._arrived.set()

    async def until(self, ending: bytes) -> None:
        """Wait (30 s at most) until the bytes received end with `ending`."""
        async with asyncio.timeout(30):
            while not self.data.endswith(ending):
                if self.closed.done():
                    raise AssertionError(f"closed with {bytes(self.data)!r}, not {ending!r}")
                self._arrived.clear()
                await self._arrived.wait()


async def exchange(
    route: Route, options: NetworkOptions, *, budget: float = 30.0, **kw: object
) -> bytes:
    """One GET over a fresh connection to `route`; the reply's bytes up to the server's close."""
    transport, protocol = await open_connection(
        route,
        Collect,
        options=options,
        connect_timeout=budget,
        **kw,  # type: ignore[arg-type]
    )
    assert protocol.made == 1 and protocol.transport is transport
    target = f"{route.origin}/probe" if route.absolute_form else "/probe"
    head = [f"GET {target} HTTP/1.1", f"Host: {route.authority}", "Connection: close"]
    if route.absolute_form:
        head += [f"{name}: {value}" for name, value in route.proxy_headers]
    transport.write(("\r\n".join(head) + "\r\n\r\n").encode())
    try:
        await asyncio.wait_for(asyncio.shield(protocol.closed), 30)
    finally:
        transport.close()
    return bytes(protocol.data)


def body(reply: bytes) -> bytes:
    return reply.partition(b"\r\n\r\n")[2]


@dataclass
class Origin:
    """A test server: its URL and what it saw."""

    url: str
    port: int
    hosts: list[str]
    alpn: list[str | None]


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Origin) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        writer.close()
        return
    for line in head.decode("latin-1").split("\r\n"):
        if line.lower().startswith("host:"):
            seen.hosts.append(line[5:].strip())
    tls = writer.get_extra_info("ssl_object")
    seen.alpn.append(tls.selected_alpn_protocol() if tls is not None else None)
    payload = b"hello from " + (b"tls" if tls is not None else b"plain")
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(payload), payload)
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def tcp_server(
    handler: Handler, host: str = "127.0.0.1", context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """A server on `host` whose every connection and handler ends when the block does.

    (Python 3.11's `Server.close()` leaves accepted connections open.)
    """
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        writers.append(writer)
        with contextlib.suppress(ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            await handler(reader, writer)

    server = await asyncio.start_server(tracked, host, 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()  # the handlers see the connection end and return
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=10)
            for task in stuck:
                task.cancel()
        await server.wait_closed()
        await asyncio.sleep(0)  # lets the aborted transports finish closing


@contextlib.asynccontextmanager
async def serve(
    context: ssl.SSLContext | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[Origin]:
    scheme = "https" if context is not None else "http"
    seen = Origin("", 0, [], [])
    async with tcp_server(lambda r, w: answer(r, w, seen), host, context) as port:
        seen.port = port
        shown = f"[{host}]" if ":" in host else host
        seen.url = f"{scheme}://{shown}:{port}"
        yield seen


def server_context(ca: trustme.CA, *, require_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1", "::1").configure_cert(context)
    context.set_alpn_protocols(["h2", "http/1.1"])
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    return context


def clean_network_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the developer's or CI's own proxy and CA settings for one test."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def black_hole(port: int) -> Iterator[str]:
    """127.0.0.2:`port` drops every SYN: a listener whose accept queue is full.

    Linux drops a SYN for a listener with a full accept queue and the client retransmits it,
    as with a host that has gone away; the fillers are never accepted.
    """
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.2", port))
    listener.listen(0)
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.5)
            try:
                filler.connect(("127.0.0.2", port))
            except TimeoutError:
                break  # this SYN was dropped: the queue is full
        else:
            pytest.skip("this kernel does not drop SYNs to a full accept queue")
        yield "127.0.0.2"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def fixed(*addresses: tuple[str, int]) -> Resolver:
    """A resolver that answers every name with `addresses`, in that order."""

    async def resolve(host: str, port: int) -> list[Address]:
        return [(socket.AF_INET, address) for address in addresses]

    return resolve
