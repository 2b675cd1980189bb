"""The HTTP layer's plain values: timeouts, reply headers, a whole reply, a streamed reply.

No I/O here. A streamed reply's body (`treadle._http.protocol.Body`) is the only value that holds
a connection; it lives with the protocol that fills it.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from treadle._frozen import quick_init
from treadle._http.errors import DecodeError, UnsupportedReply

__all__ = [
    "UPGRADE",
    "BodyStream",
    "Headers",
    "Reply",
    "StreamReply",
    "Timeouts",
    "decoder",
    "headers_of",
    "unsupported",
]

UPGRADE = "The server answered 101 Switching Protocols, an upgrade this client never asked for."
"""The message of a `101` reply (a head, or httptools' `HttpParserUpgrade`)."""


def decoder(coding: str | None, url: str) -> Any:
    """A zlib decompressor for a `content-encoding` (None: identity); `DecodeError` for a coding
    the request did not offer."""
    coding = (coding or "identity").strip().lower()
    if coding in ("identity", ""):
        return None
    if coding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if coding == "deflate":
        return zlib.decompressobj()
    raise DecodeError(f"The reply's content-encoding {coding!r} was not offered.", url=url)


def unsupported(status: int, transfer_encoding: str | None) -> UnsupportedReply | None:
    """Why a final head cannot be read, or None: a status outside 100-599 (llhttp reads `099`
    as 99, which must not pass for a 1xx), a `101` upgrade, or any transfer coding but `chunked`
    alone (as httpx: `chunked, gzip` has no framing we read, `gzip, chunked` would hand back
    still-compressed bytes)."""
    if not 100 <= status <= 599:
        return UnsupportedReply(f"The reply's status {status:03d} is not 100-599.")
    if status == 101:
        return UnsupportedReply(UPGRADE)
    coding = transfer_encoding
    if coding is not None and coding.replace(" ", "").replace("\t", "").lower() != "chunked":
        return UnsupportedReply(
            f"The reply's Transfer-Encoding {coding!r} is not supported (only 'chunked')."
        )
    return None


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds for each phase of one request (None: no limit)."""

    connect: float | None
    """DNS, TCP, proxy and TLS together."""
    read: float | None
    """The longest silence between two reads of the reply."""
    pool: float | None
    """The longest wait for a connection of the pool to become free."""


class Headers(dict[str, str]):
    """A reply's headers by lower-case name (repeated headers joined with `, `), values decoded
    as UTF-8 with a bad byte as U+FFFD (both transports: one id reads the same through either).

    Lookups are case-insensitive: `headers["Content-Type"]` and `headers.get("x-request-id")`.
    """

    __slots__ = ()

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        """The value of header `name` (any case), or `default`."""
        value = dict.get(self, name)
        return value if value is not None else dict.get(self, name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


def headers_of(raw: list[tuple[bytes, bytes]]) -> Headers:
    """`Headers` from a head's `(name, value)` byte pairs, as both transports read them: names
    lower-cased, values decoded as UTF-8 (a bad byte as U+FFFD, not Latin-1 mojibake), a repeated
    header's values joined with `, ` in order."""
    headers = Headers(
        {name.decode("latin-1").lower(): value.decode("utf-8", "replace") for name, value in raw}
    )
    if len(headers) < len(raw):  # a repeated header
        dict.clear(headers)
        for raw_name, raw_value in raw:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("utf-8", "replace")
            old = dict.get(headers, name)
            dict.__setitem__(headers, name, value if old is None else f"{old}, {value}")
    return headers


@quick_init
@dataclass(frozen=True, slots=True)
class Reply:
    """A whole reply: status, headers and the (decompressed) body."""

    status: int
    headers: Headers
    content: bytes


class BodyStream(Protocol):
    """A streamed body: iterate for byte chunks (decompressed); always `aclose()` it.

    Closing before the end closes the connection; a read after `aclose()` raises `BodyClosed`.
    """

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


@quick_init
@dataclass(frozen=True, slots=True)
class StreamReply:
    """A reply whose head arrived: status, headers and the body still to read."""

    status: int
    headers: Headers
    body: BodyStream
