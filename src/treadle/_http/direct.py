"""A direct connect (plain TCP, or TLS), behind the same names as `treadle._http.connect`.

A stand-in for the pool until the network module lands: no proxies, no Happy Eyeballs (addresses
tried in turn), the system's CAs. Every failure leaves as one of `treadle._http.errors`; one
budget covers DNS, TCP and TLS. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

from treadle._http.errors import (
    ConnectError,
    ConnectTimeout,
    InvalidURL,
    OpenFilesExhausted,
    TLSError,
)

__all__ = ["NetworkOptions", "Route", "open_connection", "route_for"]

P = TypeVar("P", bound=asyncio.BaseProtocol)

_NO_FILES = (errno.EMFILE, errno.ENFILE)
_PLAINTEXT_MARKERS = ("wrong_version_number", "wrong version number", "record layer failure",
                      "packet length too long", "http request")  # fmt: skip


@dataclass(frozen=True, slots=True)
class NetworkOptions:
    """How a Provider reaches its server (httpx's names)."""

    proxy: str | None = None
    trust_env: bool = True
    verify: bool | str | ssl.SSLContext = True
    cert: str | tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """How to reach one origin; hashable, so it is the pool's key."""

    scheme: str
    host: str
    port: int
    proxy: str | None
    absolute_form: bool
    proxy_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def authority(self) -> str:
        """The Host header's value: IPv6 bracketed, the scheme's default port omitted."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def route_for(url: str, options: NetworkOptions) -> Route:
    """The direct route to `url`'s origin; raises `InvalidURL`."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
        scheme = ""
    if scheme not in ("http", "https") or not parts.hostname:
        raise InvalidURL(f"{url!r} is not an http:// or https:// URL; check base_url.", url=url)
    host = parts.hostname
    if not host.isascii():
        host = host.encode("idna").decode("ascii")
    return Route(scheme, host, port or (443 if scheme == "https" else 80), None, False)


_contexts: dict[object, ssl.SSLContext] = {}


def _context(options: NetworkOptions) -> ssl.SSLContext:
    verify = options.verify
    if isinstance(verify, ssl.SSLContext):
        return verify
    key = (verify, options.cert)
    context = _contexts.get(key)
    if context is None:
        context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
        if verify is False:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.set_alpn_protocols(["http/1.1"])
        _contexts[key] = context
    return context


async def open_connection(
    route: Route,
    protocol_factory: Callable[[], P],
    *,
    options: NetworkOptions,
    connect_timeout: float | None,
) -> tuple[asyncio.Transport, P]:
    """Connect to `route` (TLS for https) within `connect_timeout` seconds."""
    loop = asyncio.get_running_loop()
    context = _context(options) if route.scheme == "https" else None
    where = f"{route.host}:{route.port}"
    try:
        async with asyncio.timeout(connect_timeout):
            try:
                infos = await loop.getaddrinfo(route.host, route.port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ConnectError(f"Cannot resolve {route.host!r} ({exc}).", dns=True) from exc
            last: OSError | None = None
            for family, _, proto, _, address in infos:
                host, port = str(address[0]), int(address[1])
                try:
                    transport, protocol = await loop.create_connection(
                        protocol_factory,
                        host,
                        port,
                        family=family,
                        proto=proto,
                        ssl=context,
                        server_hostname=route.host if context is not None else None,
                        ssl_handshake_timeout=connect_timeout if context is not None else None,
                    )
                    assert isinstance(transport, asyncio.Transport)
                    return transport, protocol
                except ssl.SSLError as exc:
                    text = str(exc).lower()
                    plain = any(marker in text for marker in _PLAINTEXT_MARKERS)
                    raise TLSError(
                        f"The TLS handshake with {where} failed ({exc}).", plaintext_peer=plain
                    ) from exc
                except OSError as exc:
                    if exc.errno in _NO_FILES:
                        raise OpenFilesExhausted(
                            "The process has no file descriptor left to open a connection; "
                            "raise the limit (`ulimit -n`) or run fewer passes at once."
                        ) from exc
                    last = exc
            raise ConnectError(f"Cannot connect to {where} ({last}).") from last
    except TimeoutError as exc:
        raise ConnectTimeout(f"Connecting to {where} timed out.") from exc
