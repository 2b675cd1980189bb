"""Reaching an origin: its route (proxy or direct), Happy Eyeballs, TLS, one connect budget.

`route_for(url, options)` says how to reach the URL's origin (the pool's key);
`open_connection(route, factory, ...)` resolves the host afresh (no DNS cache, so a fail-over is
seen at the next connect), races its addresses as RFC 8305 says, tunnels through a proxy with
CONNECT when the origin is https, and completes TLS, all inside one `connect_timeout`. Every
failure leaves as one of `treadle._http.errors`; nothing here blocks the event loop (resolving
runs on the loop's executor, certificate files are read on a worker thread).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from treadle._http.errors import (
    ConnectError,
    ConnectTimeout,
    OpenFilesExhausted,
    ProxyError,
)
from treadle._http.hosts import authority, parse_url
from treadle._http.proxy import (
    choose_proxy,
    connect_reader,
    environment_key,
    read_connect_reply,
)
from treadle._http.tls import handshake_error, ssl_context, ssl_context_async
from treadle.errors import ConfigurationError

__all__ = [
    "HAPPY_EYEBALLS_DELAY",
    "NetworkOptions",
    "Resolver",
    "Route",
    "open_connection",
    "route_for",
    "ssl_context",
]

P = TypeVar("P", bound=asyncio.BaseProtocol)

HAPPY_EYEBALLS_DELAY = 0.25
"""Seconds before the next address is tried while one attempt is pending (RFC 8305's 250 ms)."""

_NO_FILES = (errno.EMFILE, errno.ENFILE)

Address = tuple[int, tuple[object, ...]]
"""One resolved address: the socket family and the `sockaddr` to connect to."""

Resolver = Callable[[str, int], Awaitable[list[Address]]]
"""Resolves `(host, port)` to addresses in the order to try; raises `socket.gaierror`."""


@dataclass(frozen=True, slots=True)
class NetworkOptions:
    """How a Provider reaches its server: proxy, trust and client certificate (httpx's names)."""

    proxy: str | None = None
    """An explicit proxy URL (`http://user:pass@host:port`); wins over the environment."""
    trust_env: bool = True
    """Read HTTP(S)_PROXY / ALL_PROXY / NO_PROXY and SSL_CERT_FILE / SSL_CERT_DIR, as httpx."""
    verify: bool | str | ssl.SSLContext = True
    """True: certifi's CAs; "system": the OS store (`treadle[truststore]`); a CA file or
    directory path; False: no verification; or a ready `ssl.SSLContext`."""
    cert: str | tuple[str, str] | None = None
    """A client certificate: one PEM holding certificate and key, or `(cert_file, key_file)`."""

    def __post_init__(self) -> None:
        if not isinstance(self.verify, (bool, str, ssl.SSLContext)):
            raise ConfigurationError(
                f"verify= takes True, False, 'system', a CA path or an ssl.SSLContext, "
                f"not {type(self.verify).__name__}."
            )
        if isinstance(self.cert, tuple) and len(self.cert) != 2:
            raise ConfigurationError("cert= takes a PEM path or a (cert_file, key_file) pair.")
        if self.proxy is not None:
            choose_proxy(parse_url("http://x"), explicit=self.proxy, trust_env=False)


@dataclass(frozen=True, slots=True)
class Route:
    """How to reach one origin; hashable, so it is the pool's key."""

    scheme: str
    """The origin's scheme: "http" or "https"."""
    host: str
    """ASCII host for the wire (IDNA 2008 applied; an IPv6 address bare, without brackets)."""
    port: int
    proxy: str | None
    """The proxy's origin, `http://host:port` (never credentials), or None for direct."""
    absolute_form: bool
    """Plain http through a proxy: the request-target is the full URL, and `proxy_headers`
    go on every request."""
    proxy_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """`Proxy-Authorization` from the proxy URL's credentials: sent in the CONNECT for https,
    on each request when `absolute_form`. Kept out of `repr`."""

    @property
    def authority(self) -> str:
        """The Host header's value: IPv6 bracketed, the scheme's default port omitted."""
        return authority(self.host, self.port, self.scheme)

    @property
    def origin(self) -> str:
        """`scheme://authority`, for messages and absolute-form targets."""
        return f"{self.scheme}://{self.authority}"


def route_for(url: str, options: NetworkOptions) -> Route:
    """The route to `url`'s origin under `options`; raises `InvalidURL` for a bad URL or host.

    The answer is cached per URL, options and the values of the proxy variables, so a changed
    `HTTPS_PROXY` or `NO_PROXY` is seen at the next call; reading those variables still costs
    about 10 µs, so call it once per endpoint (httpx, too, reads them when a client is built),
    not once per request.
    """
    key = environment_key() if options.trust_env and options.proxy is None else ()
    return _route(url, options, key)


@functools.lru_cache(maxsize=512)
def _route(url: str, options: NetworkOptions, env: tuple[str | None, ...]) -> Route:
    target = parse_url(url)
    proxy = choose_proxy(target, explicit=options.proxy, trust_env=options.trust_env)
    return Route(
        scheme=target.scheme,
        host=target.host,
        port=target.port,
        proxy=None if proxy is None else proxy.url,
        absolute_form=proxy is not None and target.scheme == "http",
        proxy_headers=() if proxy is None else proxy.headers,
    )


async def open_connection(
    route: Route,
    protocol_factory: Callable[[], P],
    *,
    options: NetworkOptions,
    connect_timeout: float | None,
    resolver: Resolver | None = None,
) -> tuple[asyncio.Transport, P]:
    """Connect to `route` and return `(transport, protocol)`, as `loop.create_connection` does.

    The protocol's `connection_made` has been called once, with the returned transport (TLS
    already done for https, inside the tunnel when proxied). `connect_timeout` covers all of
    it: DNS, TCP, the proxy's CONNECT and the TLS handshake; running out is `ConnectTimeout`.
    `resolver` replaces the system resolver (tests); it is called on every connect.
    """
    try:
        async with asyncio.timeout(connect_timeout):
            return await _open(route, protocol_factory, options, connect_timeout, resolver)
    except OSError as exc:  # what no phase above turned into an HTTPError (a worker thread's)
        if isinstance(exc, TimeoutError):
            raise _timeout(route, connect_timeout) from None
        _raise_if_out_of_files(exc, route.origin)
        raise ConnectError(
            f"Connecting to {route.origin} failed ({exc}).", url=route.origin
        ) from None


def _timeout(route: Route, connect_timeout: float | None) -> ConnectTimeout:
    where = f" through the proxy {route.proxy}" if route.proxy else ""
    return ConnectTimeout(
        f"Connecting to {route.origin}{where} took longer than the {connect_timeout} s "
        "connect timeout; raise it (timeout=) if the network or server is slow.",
        url=route.origin,
    )


async def _open(
    route: Route,
    factory: Callable[[], P],
    options: NetworkOptions,
    budget: float | None,
    resolver: Resolver | None,
) -> tuple[asyncio.Transport, P]:
    loop = asyncio.get_running_loop()
    # asyncio's own handshake limit must never fire before our budget does.
    handshake = None if budget is None else budget + 30.0
    # Contexts first: a certificate file that cannot be read fails before any traffic, and no
    # connected socket waits (or leaks) while the files are read.
    context = await ssl_context_async(options) if route.scheme == "https" else None
    proxy = None if route.proxy is None else parse_url(route.proxy)
    proxy_tls = None
    if proxy is not None and proxy.scheme == "https":
        proxy_tls = context or await ssl_context_async(options)
    if route.proxy is None or proxy is None:
        sock = await _connect_tcp(route.host, route.port, route.origin, resolver)
        if context is None:
            return await _adopt(loop.create_connection(factory, sock=sock), sock, route.origin)
        return await _handshake(
            loop.create_connection(
                factory,
                sock=sock,
                ssl=context,
                server_hostname=route.host,
                ssl_handshake_timeout=handshake,
            ),
            sock,
            route.origin,
        )
    try:
        sock = await _connect_tcp(proxy.host, proxy.port, route.proxy, resolver)
    except OpenFilesExhausted:
        raise
    except ConnectError as exc:
        raise ProxyError(
            f"Cannot reach the proxy {route.proxy} ({exc}); check proxy= or HTTPS_PROXY / "
            "HTTP_PROXY, or add the host to NO_PROXY.",
            url=route.proxy,
        ) from None
    if route.absolute_form:
        if proxy_tls is None:
            return await _adopt(loop.create_connection(factory, sock=sock), sock, route.proxy)
        return await _handshake(
            loop.create_connection(
                factory,
                sock=sock,
                ssl=proxy_tls,
                server_hostname=proxy.host,
                ssl_handshake_timeout=handshake,
            ),
            sock,
            route.proxy,
        )
    reader = connect_reader(route.proxy, route.host, route.port)
    if proxy_tls is None:
        raw, _ = await _adopt(loop.create_connection(lambda: reader, sock=sock), sock, route.proxy)
    else:
        raw, _ = await _handshake(
            loop.create_connection(
                lambda: reader,
                sock=sock,
                ssl=proxy_tls,
                server_hostname=proxy.host,
                ssl_handshake_timeout=handshake,
            ),
            sock,
            route.proxy,
        )
    try:
        await read_connect_reply(raw, reader, route.proxy_headers)
        assert context is not None  # a tunnel is only for https origins
        try:
            tls = await loop.start_tls(
                raw, reader, context, server_hostname=route.host, ssl_handshake_timeout=handshake
            )
        except (OSError, ssl.SSLError) as exc:
            _raise_if_out_of_files(exc, route.origin)
            raise handshake_error(exc, route.origin) from None
    except BaseException:
        raw.close()
        raise
    if tls is None:  # start_tls returns None only when the transport is closing
        raise ConnectError(f"The tunnel to {route.origin} closed during the TLS handshake.")
    protocol = factory()
    tls.set_protocol(protocol)
    protocol.connection_made(tls)
    return tls, protocol


async def _adopt(
    opening: Awaitable[tuple[asyncio.BaseTransport, P]], sock: socket.socket, origin: str
) -> tuple[asyncio.Transport, P]:
    """Wrap a connected socket in a transport, closing the socket if that fails."""
    try:
        transport, protocol = await opening
    except BaseException:
        sock.close()
        raise
    return transport, protocol  # type: ignore[return-value]


async def _handshake(
    opening: Awaitable[tuple[asyncio.BaseTransport, P]], sock: socket.socket, origin: str
) -> tuple[asyncio.Transport, P]:
    """`_adopt` for a TLS transport: a failed handshake becomes `TLSError`."""
    try:
        return await _adopt(opening, sock, origin)
    except ConnectionAbortedError as exc:
        # asyncio's own handshake limit (only reachable with no connect budget).
        raise ConnectTimeout(
            f"The TLS handshake with {origin} did not finish ({exc}).", url=origin
        ) from None
    except (OSError, ssl.SSLError) as exc:
        _raise_if_out_of_files(exc, origin)  # OpenSSL opens files of its own on first use
        raise handshake_error(exc, origin) from None


async def _connect_tcp(
    host: str, port: int, origin: str, resolver: Resolver | None
) -> socket.socket:
    """A connected non-blocking socket to `host:port`: resolve afresh, then race the addresses."""
    addresses = await _resolve(host, port, origin, resolver)
    return await _happy_eyeballs(_interleave(addresses), origin)


async def _resolve(host: str, port: int, origin: str, resolver: Resolver | None) -> list[Address]:
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
        sockaddr: tuple[object, ...] = (host, port, 0, 0) if literal.version == 6 else (host, port)
        return [(family, sockaddr)]
    try:
        if resolver is not None:
            addresses = await resolver(host, port)
        else:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
            addresses = [(info[0], info[4]) for info in infos]
    except socket.gaierror as exc:
        raise ConnectError(
            f"The host name {host!r} did not resolve ({exc.strerror}); check the spelling of "
            "base_url and this machine's DNS.",
            url=origin,
            dns=True,
        ) from None
    except OSError as exc:
        _raise_if_out_of_files(exc, origin)
        raise ConnectError(f"Resolving {host!r} failed ({exc}).", url=origin, dns=True) from None
    if not addresses:
        raise ConnectError(f"The host name {host!r} has no address.", url=origin, dns=True)
    return addresses


def _interleave(addresses: list[Address]) -> list[Address]:
    """RFC 8305 section 4: alternate families, starting with the resolver's first choice."""
    families: dict[int, list[Address]] = {}
    for address in addresses:
        families.setdefault(address[0], []).append(address)
    queues = list(families.values())
    ordered: list[Address] = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


async def _happy_eyeballs(addresses: list[Address], origin: str) -> socket.socket:
    """Race connects to `addresses`: start the next when one fails or after 250 ms pending.

    The first to connect wins; every other attempt is cancelled and its socket closed.
    """
    loop = asyncio.get_running_loop()
    winner: list[socket.socket] = []
    errors: list[OSError] = []
    attempts: list[asyncio.Task[None]] = []
    won = asyncio.Event()

    if len(addresses) == 1:  # nothing to race (an IP literal, a name with one address)
        try:
            return await _connect_one(loop, *addresses[0])
        except OSError as exc:
            errors.append(exc)
            return _no_connection(errors, origin)

    async def attempt(family: int, sockaddr: tuple[object, ...], failed: asyncio.Event) -> None:
        try:
            sock = await _connect_one(loop, family, sockaddr)
        except OSError as exc:
            errors.append(exc)
            failed.set()
            return
        if winner:
            sock.close()
            return
        winner.append(sock)
        won.set()

    try:
        async with asyncio.TaskGroup() as group:
            for family, sockaddr in addresses:
                failed = asyncio.Event()
                attempts.append(group.create_task(attempt(family, sockaddr, failed)))
                waits = [asyncio.ensure_future(failed.wait()), asyncio.ensure_future(won.wait())]
                try:
                    await asyncio.wait(
                        waits, timeout=HAPPY_EYEBALLS_DELAY, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for wait in waits:
                        wait.cancel()
                if won.is_set() or _out_of_files(errors):
                    break
            # Out of descriptors, the pending attempts cannot help: end them now.
            if not won.is_set() and not _out_of_files(errors):
                await _first_of(won, attempts)
            for task in attempts:
                task.cancel()
    except BaseException:
        for sock in winner:
            sock.close()
        raise
    if winner:
        return winner[0]
    return _no_connection(errors, origin)


async def _connect_one(
    loop: asyncio.AbstractEventLoop, family: int, sockaddr: tuple[object, ...]
) -> socket.socket:
    """A non-blocking socket connected to `sockaddr`, or the OSError (socket closed)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, sockaddr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def _no_connection(errors: list[OSError], origin: str) -> NoReturn:
    for exc in errors:
        _raise_if_out_of_files(exc, origin)
    detail = "; ".join(dict.fromkeys(str(e.strerror or e) for e in errors)) or "no address"
    raise ConnectError(
        f"Cannot connect to {origin} ({detail}); check that the server is running and reachable.",
        url=origin,
    )


async def _first_of(won: asyncio.Event, attempts: list[asyncio.Task[None]]) -> None:
    """Wait until an attempt wins or every attempt has ended."""
    waiter = asyncio.ensure_future(won.wait())
    try:
        await asyncio.wait([waiter, *attempts], return_when=asyncio.FIRST_COMPLETED)
        while not won.is_set() and not all(task.done() for task in attempts):
            pending = [task for task in attempts if not task.done()]
            await asyncio.wait([waiter, *pending], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _out_of_files(errors: list[OSError]) -> bool:
    return any(exc.errno in _NO_FILES for exc in errors)


def _raise_if_out_of_files(exc: OSError, origin: str) -> None:
    if exc.errno in _NO_FILES:
        raise OpenFilesExhausted(
            f"The process ran out of file descriptors opening a connection to {origin} "
            f"({errno.errorcode[exc.errno]}); raise the limit (ulimit -n) or lower the "
            "number of concurrent passes.",
            url=origin,
        ) from None
