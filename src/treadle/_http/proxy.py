"""Which proxy an origin goes through (as httpx decides it), and the CONNECT tunnel.

The choice mirrors httpx's `get_environment_proxies` and `URLPattern`: an explicit `proxy=` is
used for every origin; otherwise, with `trust_env`, `HTTPS_PROXY` / `HTTP_PROXY` / `ALL_PROXY`
(lower-case first, as `urllib.request.getproxies` reads them) and `NO_PROXY` entries (`*`,
`host`, `.domain`, `host:port`, IPv4 and IPv6 addresses, `localhost`), the most specific entry
winning. The proxy's reply to CONNECT is parsed by llhttp (`httptools`), never by hand, and
bounded; no message ever carries the proxy's credentials.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
import re
from dataclasses import dataclass
from urllib.request import getproxies

import httptools

from treadle._http.errors import InvalidURL, ProxyError
from treadle._http.hosts import ParsedURL, authority, parse_url, redact_url

__all__ = [
    "ProxyChoice",
    "choose_proxy",
    "connect_reader",
    "environment_key",
    "read_connect_reply",
]

PROXY_SCHEMES = ("http", "https")
"""Proxy URL schemes Treadle speaks (SOCKS is refused with a clear error)."""

MAX_CONNECT_REPLY_BYTES = 64 * 1024
"""The most a proxy's reply head to CONNECT may hold before the tunnel is refused."""


@dataclass(frozen=True, slots=True)
class ProxyChoice:
    """The proxy for one origin: its origin URL (no credentials) and its request headers."""

    url: str
    """`http://host:port` or `https://host:port`."""
    headers: tuple[tuple[str, str], ...]
    """`Proxy-Authorization` when the proxy URL carried credentials."""


def choose_proxy(target: ParsedURL, *, explicit: str | None, trust_env: bool) -> ProxyChoice | None:
    """The proxy `target` goes through, or None to connect directly."""
    if explicit is not None:
        return _proxy_choice(explicit)
    if not trust_env:
        return None
    port = target.port if target.explicit_port else None
    for pattern, proxy in _environment_patterns():
        if pattern.matches(target.scheme, target.display_host, target.host, port):
            return None if proxy is None else _proxy_choice(proxy)
    return None


@dataclass(frozen=True, slots=True)
class _Pattern:
    """One httpx mount key (`all://*example.com`, `https://`, ...) and how it matches."""

    scheme: str
    host: str
    port: int | None
    host_regex: re.Pattern[str] | None

    @property
    def priority(self) -> tuple[int, int, int]:
        # httpx's order: a port first, then longer hosts, then longer schemes.
        return (0 if self.port is not None else 1, -len(self.host), -len(self.scheme))

    def matches(self, scheme: str, display_host: str, wire_host: str, port: int | None) -> bool:
        if self.scheme and self.scheme != scheme:
            return False
        if self.host_regex is not None and not (
            self.host_regex.match(display_host) or self.host_regex.match(wire_host)
        ):
            return False
        return self.port is None or self.port == port


def _pattern(key: str) -> _Pattern:
    scheme, _, rest = key.partition("://")
    netloc = rest.split("/", 1)[0]
    host, port = netloc, None
    if netloc.startswith("["):
        host, _, tail = netloc[1:].partition("]")
        if tail.startswith(":") and tail[1:].isdigit():
            port = int(tail[1:])
    elif netloc.count(":") == 1:
        host, _, port_text = netloc.partition(":")
        port = int(port_text) if port_text.isdigit() else None
    host = host.lower()
    scheme = "" if scheme == "all" else scheme
    if port is not None and port == {"http": 80, "https": 443}.get(scheme):
        port = None  # httpx's URL drops a scheme's default port, so it matches any
    host = "" if host == "*" else host
    regex: re.Pattern[str] | None = None
    if host.startswith("*."):
        regex = re.compile(f"^.+\\.{re.escape(host[2:])}$")
    elif host.startswith("*"):
        regex = re.compile(f"^(.+\\.)?{re.escape(host[1:])}$")
    elif host:
        regex = re.compile(f"^{re.escape(host)}$")
    return _Pattern(scheme, host, port, regex)


_PROXY_VARIABLES = tuple(
    name
    for base in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "request_method")
    for name in (base, base.upper())
)


def environment_key() -> tuple[str | None, ...]:
    """The values `choose_proxy` reads from the environment, as a cache key (a few µs)."""
    get = os.environ.get
    return tuple(get(name) for name in _PROXY_VARIABLES)


def _environment_patterns() -> list[tuple[_Pattern, str | None]]:
    """httpx's `get_environment_proxies`, as patterns sorted most specific first."""
    info = getproxies()
    mounts: dict[str, str | None] = {}
    for scheme in ("http", "https", "all"):
        if info.get(scheme):
            value = info[scheme]
            mounts[f"{scheme}://"] = value if "://" in value else f"http://{value}"
    for entry in (h.strip() for h in info.get("no", "").split(",")):
        if entry == "*":
            return []
        if not entry:
            continue
        if "://" in entry:
            mounts[entry] = None
        elif _is_ip(entry, ipaddress.IPv4Address):
            mounts[f"all://{entry}"] = None
        elif _is_ip(entry, ipaddress.IPv6Address):
            mounts[f"all://[{entry}]"] = None
        elif entry.lower() == "localhost":
            mounts[f"all://{entry}"] = None
        else:
            mounts[f"all://*{entry}"] = None
    patterns = [(_pattern(key), proxy) for key, proxy in mounts.items()]
    return sorted(patterns, key=lambda item: item[0].priority)


def _is_ip(text: str, kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    try:
        kind(text.split("/")[0])
    except ValueError:
        return False
    return True


def _proxy_choice(url: str) -> ProxyChoice:
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme.startswith("socks"):
        raise InvalidURL(
            f"SOCKS proxies ({scheme}://) are not supported; use an HTTP proxy URL "
            "(http://host:port), or pass http_client=httpx.AsyncClient(proxy=...)."
        )
    userinfo = url.partition("://")[2].rpartition("@")[0]
    if any(c in userinfo for c in "/?#"):
        # urlsplit would end the host at that character and take part of the password for it.
        raise InvalidURL(
            f"The proxy URL {redact_url(url)!r} has '/', '?' or '#' in its user name or "
            "password; percent-encode them (%2F, %3F, %23)."
        )
    proxy = parse_url(url, schemes=PROXY_SCHEMES, what="proxy URL")
    headers: tuple[tuple[str, str], ...] = ()
    if proxy.username or proxy.password:
        token = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode("ascii")
        headers = (("Proxy-Authorization", f"Basic {token}"),)
    return ProxyChoice(
        url=f"{proxy.scheme}://{authority(proxy.host, proxy.port, '')}", headers=headers
    )


class _ConnectReply(asyncio.Protocol):
    """Reads the proxy's reply head to CONNECT through llhttp; bytes after it are refused.

    Interim `1xx` heads (but `101`) are skipped, as httpcore skips them, and the final head's
    status and reason are the ones reported. The final head ends at its blank line: every byte
    the proxy sent after it (a body, a second head, TLS bytes of its own) is refused.
    """

    def __init__(self, proxy: str, target: str) -> None:
        self.proxy, self.target = proxy, target
        self._parser = httptools.HttpResponseParser(self)
        self._reason = bytearray()
        self._seen = bytearray()
        self._heads = 0
        self._final: int | None = None
        self.head: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.early_bytes = False

    # llhttp callbacks
    def on_message_begin(self) -> None:
        if self._final is None:
            self._reason.clear()  # each head has its own reason phrase
        else:
            self.early_bytes = True

    def on_status(self, status: bytes) -> None:
        if self._final is None:
            self._reason += status[: max(0, 200 - len(self._reason))]

    def on_headers_complete(self) -> None:
        if self._final is not None:
            self.early_bytes = True
            return
        self._heads += 1
        status = self._parser.get_status_code()
        if not (100 <= status < 200 and status != 101):
            self._final = status

    def on_body(self, body: bytes) -> None:
        self.early_bytes = True

    def on_chunk_header(self) -> None:
        self.early_bytes = True

    # asyncio callbacks
    def data_received(self, data: bytes) -> None:
        if self.head.done():
            self.early_bytes = True
            return
        self._seen += data
        if len(self._seen) > MAX_CONNECT_REPLY_BYTES:
            self._fail(f"sent a reply head over {MAX_CONNECT_REPLY_BYTES} bytes")
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._final is None:
                self._fail(f"sent a malformed reply ({type(exc).__name__})")
                return
            self.early_bytes = True  # the bytes after the final head are not HTTP
        if self._final is not None:
            # llhttp accepts an empty line between messages silently: count the bytes instead.
            # A head written with CRLFs holds CRLFCRLF only at its end, so the n-th one ends
            # the n-th head.
            end = 0
            try:
                for _ in range(self._heads):
                    end = self._seen.index(b"\r\n\r\n", end) + 4
            except ValueError:
                self._fail("sent a reply head not ended by CRLF CRLF")
                return
            if len(self._seen) > end:
                self.early_bytes = True
            self.head.set_result(self._final)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("closed the connection before answering")

    def reason(self) -> str:
        """The reply's reason phrase, printable characters only (it is the peer's text)."""
        text = self._reason.decode("latin-1")
        return "".join(c if c.isprintable() else "?" for c in text).strip()

    def _fail(self, what: str) -> None:
        if not self.head.done():
            self.head.set_exception(
                ProxyError(
                    f"The proxy {self.proxy} {what} to CONNECT {self.target}; check the "
                    "proxy URL (proxy= or HTTPS_PROXY).",
                    url=self.proxy,
                )
            )


async def read_connect_reply(
    transport: asyncio.Transport, reader: _ConnectReply, headers: tuple[tuple[str, str], ...]
) -> None:
    """Send CONNECT on `transport` (whose protocol is `reader`) and await a 2xx reply."""
    lines = [f"CONNECT {reader.target} HTTP/1.1", f"Host: {reader.target}"]
    lines += [f"{name}: {value}" for name, value in headers]
    transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    status = await reader.head
    if not 200 <= status < 300:
        hint = (
            "check the credentials in the proxy URL"
            if status == 407
            else "ask the proxy's administrator whether this host is allowed"
        )
        reason = reader.reason()
        for secret in _secrets(headers):
            reason = reason.replace(secret, "***")  # a proxy may echo the credentials back
        raise ProxyError(
            f"The proxy {reader.proxy} refused CONNECT {reader.target} with {status} "
            f"{reason}; {hint}.",
            url=reader.proxy,
        )
    if reader.early_bytes:
        raise ProxyError(
            f"The proxy {reader.proxy} sent bytes after its {status} reply to CONNECT "
            f"{reader.target} before the TLS handshake began; it is not a tunnelling proxy.",
            url=reader.proxy,
        )


def connect_reader(proxy: str, target_host: str, target_port: int) -> _ConnectReply:
    """A protocol that reads one CONNECT reply for `target_host:target_port` via `proxy`."""
    return _ConnectReply(proxy, authority(target_host, target_port, ""))


def _secrets(headers: tuple[tuple[str, str], ...]) -> list[str]:
    """The Basic token and the password inside it, longest first."""
    found: list[str] = []
    for name, value in headers:
        if name.lower() == "proxy-authorization" and value.startswith("Basic "):
            token = value[len("Basic ") :]
            password = base64.b64decode(token).decode().partition(":")[2]
            found += [token, password]
    return sorted((s for s in found if s), key=len, reverse=True)
