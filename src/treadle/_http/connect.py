"""Reaching an origin: its route (proxy or direct), Happy Eyeballs, TLS, one connect budget.

`route_for(url, options)` says how to reach the URL's origin (the pool's key);
`open_connection(route, factory, ...)` dials the host (`treadle._http.dial`: one lookup per name
at a time, answers kept 10 s and dropped when they fail, addresses raced as RFC 8305 says),
tunnels through a proxy with CONNECT when the origin is https, and completes TLS, all inside
one `connect_timeout` (which starts once the TLS contexts are loaded: local work). Every
failure leaves as one of `treadle._http.errors`; nothing here blocks the event loop (resolving
runs on the loop's executor, certificate files are read on a worker thread).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from treadle._http.dial import (
    DNS_CACHE_SECONDS,
    HAPPY_EYEBALLS_DELAY,
    Address,
    Resolver,
    dial,
    raise_if_out_of_files,
)
from treadle._http.errors import (
    ConnectError,
    ConnectTimeout,
    HTTPError,
    OpenFilesExhausted,
    ProxyError,
)
from treadle._http.hosts import authority, parse_url, redact_url
from treadle._http.proxy import (
    choose_proxy,
    connect_reader,
    environment_key,
    read_connect_reply,
)
from treadle._http.tls import (
    first_bytes_after_hello,
    handshake_error,
    not_tls,
    ssl_context,
    ssl_context_async,
)
from treadle.errors import ConfigurationError

__all__ = [
    "DNS_CACHE_SECONDS",
    "HAPPY_EYEBALLS_DELAY",
    "Address",
    "NetworkOptions",
    "Resolver",
    "Route",
    "open_connection",
    "route_for",
    "ssl_context",
]

P = TypeVar("P", bound=asyncio.BaseProtocol)


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

    def __repr__(self) -> str:
        # The proxy URL may carry a password: show it without its credentials.
        proxy = None if self.proxy is None else redact_url(self.proxy)
        return (
            f"NetworkOptions(proxy={proxy!r}, trust_env={self.trust_env!r}, "
            f"verify={self.verify!r}, cert={self.cert!r})"
        )


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
    the network's part: DNS, TCP, the proxy's CONNECT and the TLS handshake; running out is
    `ConnectTimeout`. Loading the TLS contexts (certificate files) comes first, outside it.
    `resolver` replaces the system resolver (tests); its answers are cached like the system's.
    """
    try:
        # Outside the budget: reading the CA files is local work, once per process and settings
        # (certifi's bundle: tens of ms of CPU, over a second of wall clock on a loaded machine).
        # Charged to the budget, a short connect timeout ran out before a byte was sent and was
        # reported as a slow network; its retry, waiting on the same build, often did too.
        contexts = await _contexts(route, options)
        async with asyncio.timeout(connect_timeout) as scope:
            return await _open(route, protocol_factory, contexts, scope.when(), resolver)
    except OSError as exc:  # what no phase above turned into an HTTPError (a worker thread's)
        if isinstance(exc, TimeoutError):
            raise _timeout(route, connect_timeout) from None
        raise_if_out_of_files(exc, route.origin)
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


_Contexts = tuple[ssl.SSLContext | None, ssl.SSLContext | None]


async def _contexts(route: Route, options: NetworkOptions) -> _Contexts:
    """The TLS contexts `route` needs: `(origin's, proxy's)`, None where it speaks plain TCP.

    Before any traffic: a certificate file that cannot be read fails first, and no connected
    socket waits (or leaks) while the files are read.
    """
    https_proxy = route.proxy is not None and parse_url(route.proxy).scheme == "https"
    if route.scheme != "https" and not https_proxy:
        return None, None
    context = await ssl_context_async(options)  # one context serves the origin and the proxy
    return (context if route.scheme == "https" else None), (context if https_proxy else None)


async def _open(
    route: Route,
    factory: Callable[[], P],
    contexts: _Contexts,
    deadline: float | None,
    resolver: Resolver | None,
) -> tuple[asyncio.Transport, P]:
    loop = asyncio.get_running_loop()
    # asyncio's own handshake limit must never fire before our budget does.
    handshake = None if deadline is None else max(0.0, deadline - loop.time()) + 30.0
    context, proxy_tls = contexts
    proxy = None if route.proxy is None else parse_url(route.proxy)
    if route.proxy is None or proxy is None:
        sock = await dial(route.host, route.port, route.origin, resolver)
        if context is None:
            return await _adopt(loop.create_connection(factory, sock=sock), sock, route.origin)
        tls_context = context

        async def plain_http() -> bool:
            return await _answers_in_plain_http(route, tls_context, resolver, deadline)

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
            plain_http,
        )
    try:
        sock = await dial(proxy.host, proxy.port, route.proxy, resolver)
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
            raise_if_out_of_files(exc, route.origin)
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
    opening: Awaitable[tuple[asyncio.BaseTransport, P]],
    sock: socket.socket,
    origin: str,
    plain_http: Callable[[], Awaitable[bool]] | None = None,
) -> tuple[asyncio.Transport, P]:
    """`_adopt` for a TLS transport: a failed handshake becomes `TLSError`.

    When the peer answered with bytes that are not TLS, `plain_http()` looks at what they were.
    """
    try:
        return await _adopt(opening, sock, origin)
    except ConnectionAbortedError as exc:
        # asyncio's own handshake limit (only reachable with no connect budget).
        raise ConnectTimeout(
            f"The TLS handshake with {origin} did not finish ({exc}).", url=origin
        ) from None
    except (OSError, ssl.SSLError) as exc:
        raise_if_out_of_files(exc, origin)  # OpenSSL opens files of its own on first use
        plain = not_tls(exc) and plain_http is not None and await plain_http()
        raise handshake_error(exc, origin, plain_http=plain) from None


PROBE_SECONDS = 2.0
"""The longest a look at a non-TLS answer may take (within what is left of the budget)."""


async def _answers_in_plain_http(
    route: Route, context: ssl.SSLContext, resolver: Resolver | None, deadline: float | None
) -> bool:
    """Whether `route`'s server answers a ClientHello with `HTTP/`, on a second connection.

    The failed handshake's bytes were consumed by the TLS layer, so a fresh connection sends the
    same ClientHello (nothing else: no request, no key) and reads the first five bytes of the
    answer. Any failure, or the budget nearly spent, means "not shown to be HTTP".
    """
    loop = asyncio.get_running_loop()
    limit = loop.time() + PROBE_SECONDS
    if deadline is not None:
        limit = min(limit, deadline - 0.05)  # the connect budget must not run out in here
    try:
        async with asyncio.timeout_at(limit):
            sock = await dial(route.host, route.port, route.origin, resolver)
            try:
                first = await first_bytes_after_hello(sock, context, route.host)
            finally:
                sock.close()
    except (OSError, HTTPError):  # TimeoutError is an OSError
        return False
    return first.startswith(b"HTTP/")
