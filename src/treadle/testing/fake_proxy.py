"""A forward HTTP proxy and a TLS front on 127.0.0.1, for tests of proxies and certificates.

`FakeProxy` behaves as a corporate proxy does for the two ways clients use one: `CONNECT
host:port` opens a byte tunnel (https origins; the proxy never sees inside the TLS), and a
request whose target is a full URL (`GET http://host:port/path`) is forwarded to that origin
(plain http). With `auth=("user", "pass")` it answers 407 unless `Proxy-Authorization` carries
them. Every request head is recorded in `requests`. It only ever connects to loopback
addresses (127.0.0.0/8, ::1, localhost): any other target gets 403, so a test or a docs example
can never send traffic off the machine through it. `TLSFront` puts TLS (mutual, if asked) in
front of a plain server such as `FakeOpenAIServer`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import ssl as ssl_module
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from treadle.testing.fake_thread import BackgroundServing

__all__ = ["FakeProxy", "ProxiedRequest", "TLSFront"]

MAX_HEAD_BYTES = 64 * 1024
"""The longest request head the proxy reads before answering 431."""


@dataclass(frozen=True, slots=True)
class ProxiedRequest:
    """One request head the proxy received."""

    method: str
    target: str
    """`host:port` for CONNECT, the full URL for a forwarded request."""
    proxy_authorization: str | None
    """The `Proxy-Authorization` value as sent (a test helper: it records credentials)."""


class FakeProxy(BackgroundServing):
    """A forward proxy on 127.0.0.1 (random free port): `with FakeProxy() as proxy: proxy.url`."""

    _thread_name = "treadle-fake-proxy"

    def __init__(
        self,
        *,
        auth: tuple[str, str] | None = None,
        host: str = "127.0.0.1",
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.ssl = ssl
        """A server context makes this an `https://` proxy (clients speak TLS to it first)."""
        self.port = 0
        self.auth = auth
        self.requests: list[ProxiedRequest] = []
        """Every request head received, in order."""
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """`http://[user:pass@]127.0.0.1:PORT` (`https://` with `ssl=`): for `proxy=`."""
        creds = f"{self.auth[0]}:{self.auth[1]}@" if self.auth else ""
        scheme = "https" if self.ssl is not None else "http"
        return f"{scheme}://{creds}{self.host}:{self.port}"

    # -- serving ---------------------------------------------------------------------------------

    async def start_serving(self) -> None:
        """Listen on the current loop; the port is known afterwards."""
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.ssl)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop_serving(self) -> None:
        """Stop listening and close every tunnel."""
        if self._server is not None:
            self._server.close()
        # Abort the connections first: their handlers see the end and return. Cancelling a
        # handler instead makes asyncio's stream callback log the CancelledError.
        for writer in list(self._writers):
            writer.transport.abort()
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=10)
            for task in stuck:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    @contextlib.contextmanager
    def _owned(self, writer: asyncio.StreamWriter) -> Iterator[list[asyncio.StreamWriter]]:
        """Track the serving task and its client until the block ends, then close the client and
        every stream the block appended (its upstream) and forget them (`stop_serving` aborts
        what is still open)."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        sides = [writer]
        try:
            yield sides
        finally:
            for side in sides:
                side.close()
            self._tasks.discard(task)
            self._writers.discard(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._owned(writer) as sides:
            try:
                head = await self._admit(reader, writer)
                if head is None:
                    return
                method, target, headers = head
                if method == "CONNECT":
                    host, _, port = target.rpartition(":")
                    opened = await self._open(host.strip("[]"), port, writer)
                    if opened is None:
                        return
                    up_reader, upstream = opened
                    sides.append(upstream)
                    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    await writer.drain()
                    await self._pipe_both(reader, writer, up_reader, upstream)
                    return
                await self._forward(reader, writer, method, target, headers)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass

    async def _forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: str,
        target: str,
        headers: dict[str, str],
    ) -> None:
        """Plain http: rewrite each absolute-form request to origin-form and relay the replies.

        Keep-alive: the next request on the connection may name another origin, which then gets
        a connection of its own. Request bodies are relayed by `Content-Length` only.
        """
        origin: tuple[str, int] | None = None
        upstream: asyncio.StreamWriter | None = None
        replies: asyncio.Task[None] | None = None
        try:
            while True:
                parts = urlsplit(target)
                if parts.scheme != "http" or not parts.hostname:
                    await self._answer(writer, b"400 Bad Request")
                    return
                wanted = (parts.hostname, parts.port or 80)
                if wanted != origin or upstream is None or upstream.is_closing():
                    if replies is not None:
                        replies.cancel()
                    if upstream is not None:
                        upstream.close()
                    opened = await self._open(wanted[0], str(wanted[1]), writer)
                    if opened is None:
                        return
                    up_reader, upstream = opened
                    origin = wanted
                    replies = asyncio.create_task(self._pipe(up_reader, writer))
                path = parts.path or "/"
                path += f"?{parts.query}" if parts.query else ""
                lines = [f"{method} {path} HTTP/1.1"]
                lines += [f"{k}: {v}" for k, v in headers.items() if k != "proxy-authorization"]
                upstream.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                length = int(headers.get("content-length", "0"))
                if length:
                    upstream.write(await reader.readexactly(length))
                await upstream.drain()
                head = await self._admit(reader, writer)
                if head is None:
                    return
                method, target, headers = head
        finally:
            if replies is not None:
                replies.cancel()
                with contextlib.suppress(BaseException):
                    await replies
            if upstream is not None:
                upstream.close()

    async def _admit(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[str, str, dict[str, str]] | None:
        """The next request head, recorded; None when there is none or it was refused (407)."""
        head = await self._read_head(reader, writer)
        if head is None:
            return None
        method, target, headers = head
        auth = headers.get("proxy-authorization")
        self.requests.append(ProxiedRequest(method, target, auth))
        if not self._authorized(auth):
            await self._answer(writer, b"407 Proxy Authentication Required")
            return None
        return head

    async def _read_head(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[str, str, dict[str, str]] | None:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            await self._answer(writer, b"431 Request Header Fields Too Large")
            return None
        except asyncio.IncompleteReadError:
            return None
        if len(raw) > MAX_HEAD_BYTES:
            await self._answer(writer, b"431 Request Header Fields Too Large")
            return None
        request_line, *lines = raw.decode("latin-1").split("\r\n")
        method, target, _ = [*request_line.split(" "), "", ""][:3]
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return method, target, headers

    def _authorized(self, header: str | None) -> bool:
        if self.auth is None:
            return True
        token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode("ascii")
        return header == f"Basic {token}"

    async def _open(
        self, host: str, port: str, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        if not _is_loopback(host) or not port.isdigit():
            await self._answer(writer, b"403 Forbidden")
            return None
        try:
            return await asyncio.open_connection(host, int(port))
        except OSError:
            await self._answer(writer, b"502 Bad Gateway")
            return None

    async def _pipe_both(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        upstream: asyncio.StreamWriter,
    ) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._pipe(reader, upstream))
            group.create_task(self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except OSError:  # a reset or a TLS alert from either side ends the pipe
            pass
        # The source ended (not cancelled: a forwarding connection that changes origin cancels
        # the old origin's pipe, and its client stays open). Pass the end on: half-close where
        # the transport can (TCP), else close (TLS).
        if sink.can_write_eof():
            with contextlib.suppress(OSError):
                sink.write_eof()
        else:
            sink.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: bytes) -> None:
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()


class TLSFront(FakeProxy):
    """TLS in front of a plain server on 127.0.0.1, as a gateway with its own CA stands in
    front of a model server: test `verify=` and `cert=` against `FakeOpenAIServer`.

    `TLSFront(server.port, ssl=context)`: the server context carries the front's certificate
    (and `verify_mode = CERT_REQUIRED` with the CA loaded, for mutual TLS); every connection is
    relayed byte for byte to `127.0.0.1:target_port`.
    """

    def __init__(self, target_port: int, *, ssl: ssl_module.SSLContext) -> None:
        super().__init__(ssl=ssl)
        self.target_port = target_port

    @property
    def url(self) -> str:
        """`https://127.0.0.1:PORT`: the origin to put in `base_url` (add the path, `/v1`)."""
        return f"https://{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._owned(writer) as sides:
            try:
                up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.target_port)
                sides.append(upstream)
                await self._pipe_both(reader, writer, up_reader, upstream)
            except (OSError, ExceptionGroup):
                pass


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
