"""URLs to the host, port and scheme the wire uses: IDNA 2008 names, IPv4 and IPv6 literals.

Hosts are encoded as httpx encodes them (`idna.encode` for non-ASCII names, so `faß.de` is
`xn--fa-hia.de`, never IDNA 2003's `fass.de`); every host httpx refuses is refused here too, and
ASCII names holding characters no DNS name or IP literal can hold are refused instead of being
percent-encoded and sent to the resolver. Pure functions: no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import idna

from treadle._http.errors import InvalidURL

__all__ = ["DEFAULT_PORTS", "ParsedURL", "authority", "encode_host", "parse_url", "redact_url"]

DEFAULT_PORTS = {"http": 80, "https": 443}
"""The port each scheme implies when a URL names none."""

_IPV4_STYLE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$")
# Letters, digits, hyphens and dots, plus the underscore some internal names carry (httpx and
# every resolver accept it); anything else in an ASCII host is a typo or an injection attempt.
_ASCII_NAME = re.compile(r"^[a-z0-9_.-]+$")


@dataclass(frozen=True, slots=True)
class ParsedURL:
    """The parts of an http(s) URL that connecting needs; `host` is the wire's ASCII form."""

    scheme: str
    host: str
    """ASCII host: an IDNA 2008 A-label name, a dotted IPv4 address or a bare IPv6 address."""
    port: int
    explicit_port: bool
    """True when the URL named a port other than the scheme's default."""
    display_host: str
    """The host as written (lower-cased, Unicode kept), for matching `NO_PROXY` as httpx does."""
    username: str
    password: str


def parse_url(
    url: str, *, schemes: tuple[str, ...] = ("http", "https"), what: str = "URL"
) -> ParsedURL:
    """Split `url` and encode its host for the wire; raise `InvalidURL` naming the fault.

    Credentials in `url` are returned decoded (for a proxy's Proxy-Authorization) and never put
    in an error message: messages show the URL's scheme and host only, and never the splitter's
    own error text (it quotes the whole `user:password@host`). ASCII control characters (tab,
    CR, LF included) are refused anywhere, as httpx refuses them, instead of being dropped by
    `urlsplit` (which would turn `api.example.com<LF>.evil.example` into another host).
    """
    text = url.strip(" ")
    if any(c.isascii() and not c.isprintable() for c in text):
        raise InvalidURL(
            f"The {what} {_safe(url)} holds a control character (such as a tab or a line "
            "break); remove it, or percent-encode it in a user name or password."
        )
    try:
        parts = urlsplit(text)
        raw_host = parts.hostname
    except ValueError:
        raise InvalidURL(
            f"The {what} {_safe(url)} is malformed; fix it (percent-encode any special "
            "character in a user name or password)."
        ) from None
    try:
        port = parts.port
    except ValueError:
        raise InvalidURL(
            f"The {what} {_safe(url)} has a port that is not a number in 1-65535; fix it."
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        allowed = " or ".join(f"{s}://" for s in schemes)
        raise InvalidURL(f"The {what} {_safe(url)} must start with {allowed}.")
    if not raw_host:
        raise InvalidURL(f"The {what} {_safe(url)} has no host; write it as {scheme}://host/.")
    if port is not None and not 0 < port < 65536:
        raise InvalidURL(f"The {what} {_safe(url)} has port {port}, outside 1-65535.")
    bracketed = "[" in parts.netloc.rpartition("@")[2]
    host = encode_host(f"[{raw_host}]" if bracketed else raw_host)
    default = DEFAULT_PORTS.get(scheme, 0)
    return ParsedURL(
        scheme=scheme,
        host=host,
        port=port if port is not None else default,
        explicit_port=port is not None and port != default,
        display_host=raw_host,
        username=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
    )


def encode_host(host: str) -> str:
    """The wire form of `host`, as httpx's `encode_host` gives it; raise `InvalidURL` if invalid.

    `[::1]` comes back bare (`::1`); the caller brackets it where a Host header needs it.
    """
    if _IPV4_STYLE.match(host):
        try:
            ipaddress.IPv4Address(host)
        except ipaddress.AddressValueError:
            raise InvalidURL(f"The host {host!r} is not a valid IPv4 address.") from None
        return host
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ipaddress.AddressValueError:
            raise InvalidURL(f"The host {host!r} is not a valid IPv6 address.") from None
        return host[1:-1]
    lowered = host.lower()
    if lowered.isascii():
        if not _ASCII_NAME.match(lowered) or ".." in lowered or lowered.startswith("."):
            raise InvalidURL(f"The host {host!r} is not a valid host name.")
        return lowered
    try:
        return idna.encode(lowered).decode("ascii")
    except idna.IDNAError as exc:
        raise InvalidURL(
            f"The host {host!r} is not a valid IDNA 2008 name ({exc}); check its spelling."
        ) from None


def authority(host: str, port: int, scheme: str) -> str:
    """`host[:port]` for a Host header or a CONNECT target: IPv6 bracketed, default port omitted
    only when `scheme` is given and the port is its default."""
    shown = f"[{host}]" if ":" in host else host
    return shown if DEFAULT_PORTS.get(scheme) == port else f"{shown}:{port}"


def redact_url(url: str) -> str:
    """`url` without its user name and password (`http://***@host:port`), path or query.

    Everything up to the last `@` is taken for credentials, so a password holding an unencoded
    `/`, `?` or `#` is hidden too.
    """
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "", scheme
    _, at, hostpart = rest.rpartition("@")
    netloc = re.split(r"[/?#]", hostpart, maxsplit=1)[0]
    shown = f"***@{netloc}" if at else netloc
    return f"{scheme}://{shown}" if sep else shown or "(empty)"


def _safe(url: str) -> str:
    """`url` for a message: scheme and host only, so no credential, path or query leaks."""
    return repr(redact_url(url))
