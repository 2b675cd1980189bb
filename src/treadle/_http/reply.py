"""The HTTP layer's plain values: timeouts, reply headers, a whole reply, a streamed reply.

No I/O here. A streamed reply's body (`treadle._http.protocol.Body`) is the only value that holds
a connection; it lives with the protocol that fills it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

__all__ = ["BodyStream", "Headers", "Reply", "StreamReply", "Timeouts"]


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
    """A reply's headers by lower-case name (repeated headers joined with `, `).

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


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A reply whose head arrived: status, headers and the body still to read."""

    status: int
    headers: Headers
    body: BodyStream
