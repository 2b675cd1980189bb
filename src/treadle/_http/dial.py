"""Dialing: from a host and port to a connected TCP socket, as RFC 8305 says.

A name is resolved by the system resolver on the loop's executor (or an injected `Resolver`),
one lookup at a time per name however many connections wait for it; its answer is reused for
`DNS_CACHE_SECONDS` at most and dropped as soon as no address of it connects, so a DNS
fail-over is seen at the next attempt. The addresses are raced (Happy Eyeballs): families
alternate, and the next address starts when the previous one failed or after 250 ms pending.
Running out of file descriptors is `OpenFilesExhausted`, never a plain connect failure.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import NoReturn

from treadle._http.errors import ConnectError, OpenFilesExhausted

__all__ = [
    "DNS_CACHE_SECONDS",
    "HAPPY_EYEBALLS_DELAY",
    "Address",
    "Resolver",
    "dial",
    "raise_if_out_of_files",
]

_NO_SUCH_HOST = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)
"""`getaddrinfo` answers that say the name does not exist (not that the DNS is down for now)."""

HAPPY_EYEBALLS_DELAY = 0.25
"""Seconds before the next address is tried while one attempt is pending (RFC 8305's 250 ms)."""

DNS_CACHE_SECONDS = 10.0
"""How long a name's addresses are reused for new connections (aiohttp's default; the old lane
kept them 300 s, and kept them after they failed)."""

MAX_CACHED_NAMES = 256
"""Names whose answers are kept at once; past it the cache starts again empty."""

_NO_FILES = (errno.EMFILE, errno.ENFILE)

Address = tuple[int, tuple[object, ...]]
"""One resolved address: the socket family and the `sockaddr` to connect to."""

Resolver = Callable[[str, int], Awaitable[list[Address]]]
"""Resolves `(host, port)` to addresses in the order to try; raises `socket.gaierror`."""


async def dial(host: str, port: int, origin: str, resolver: Resolver | None) -> socket.socket:
    """A connected non-blocking TCP socket to `host:port`, or a `ConnectError`.

    `origin` names the server in messages. A name's addresses are raced (Happy Eyeballs); when
    none connects, its cached answer is dropped so the next attempt asks the resolver again.
    """
    literal = _literal(host, port)
    if literal is not None:
        return await _happy_eyeballs([literal], origin)
    key = (host, port, resolver)
    addresses = await _resolve(key, origin)
    try:
        return await _happy_eyeballs(_interleave(addresses), origin)
    except BaseException:
        _answers.pop(key, None)  # a fail-over in DNS is seen at the next attempt
        raise


def _literal(host: str, port: int) -> Address | None:
    """The address of an IP literal `host`; None for a name (to resolve)."""
    family = _literals.get(host, _UNKNOWN)
    if family is _UNKNOWN:
        # Told once per host: parsing is about 2.4 µs a connection (3.7 µs for a name, which
        # raises), and a fan-out opens hundreds of connections to one host.
        try:
            version = ipaddress.ip_address(host).version
        except ValueError:
            family = None
        else:
            family = socket.AF_INET6 if version == 6 else socket.AF_INET
        if len(host) <= MAX_LITERAL_HOST:  # no valid name or literal is longer: not kept
            if len(_literals) >= MAX_CACHED_NAMES:
                _literals.clear()
            _literals[host] = family
    if family is None:
        return None
    if family == socket.AF_INET6:
        return (socket.AF_INET6, (host, port, 0, 0))
    return (socket.AF_INET, (host, port))


_UNKNOWN = -1
MAX_LITERAL_HOST = 255
"""Longest host kept in `_literals` (a DNS name has at most 253 characters): a hostile base URL
with a megabyte-long host is told afresh each time, not kept."""
_literals: dict[str, int | None] = {}
"""Host -> the socket family of an IP literal, None for a name; at most `MAX_CACHED_NAMES`."""


_Key = tuple[str, int, "Resolver | None"]
_answers: dict[_Key, tuple[float, list[Address]]] = {}
_lookups: dict[tuple[asyncio.AbstractEventLoop, _Key], asyncio.Task[list[Address]]] = {}


async def _resolve(key: _Key, origin: str) -> list[Address]:
    """The addresses of `key`'s host: cached for `DNS_CACHE_SECONDS`, one lookup at a time."""
    host = key[0]
    loop = asyncio.get_running_loop()
    cached = _answers.get(key)
    if cached is not None and cached[0] > loop.time():
        return cached[1]
    lookup = _lookups.get((loop, key))
    if lookup is None:
        # Single-flight: a burst of new connections to one host makes one lookup, not one each.
        lookup = loop.create_task(_lookup(*key))
        _lookups[(loop, key)] = lookup
        lookup.add_done_callback(lambda done: _forget_lookup(loop, key, done))
    try:
        # Shielded: one waiter's cancellation must not cancel the lookup the others wait for.
        addresses = await asyncio.shield(lookup)
    except socket.gaierror as exc:
        raise ConnectError(
            f"The host name {host!r} did not resolve ({exc.strerror}); check the spelling of "
            "base_url and this machine's DNS.",
            url=origin,
            dns=True,
            no_such_host=exc.errno in _NO_SUCH_HOST,
        ) from None
    except OSError as exc:
        raise_if_out_of_files(exc, origin)
        raise ConnectError(f"Resolving {host!r} failed ({exc}).", url=origin, dns=True) from None
    except Exception as exc:  # an injected resolver's own bug is still a failed lookup
        raise ConnectError(
            f"Resolving {host!r} failed: the resolver raised {type(exc).__name__}; fix the "
            "resolver passed to the Provider.",
            url=origin,
            dns=True,
        ) from None
    if not addresses:
        raise ConnectError(
            f"The host name {host!r} has no usable address; check this machine's DNS.",
            url=origin,
            dns=True,
        )
    if len(_answers) >= MAX_CACHED_NAMES:
        _answers.clear()  # many names: one process talks to a handful of endpoints, not 1,000
    _answers[key] = (loop.time() + DNS_CACHE_SECONDS, addresses)
    return addresses


async def _lookup(host: str, port: int, resolver: Resolver | None) -> list[Address]:
    if resolver is not None:
        answer: object = await resolver(host, port)
        # An injected resolver may answer anything: keep only entries a TCP connect can use.
        return [a for a in answer if _usable(a)] if isinstance(answer, list) else []
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [(info[0], info[4]) for info in infos]


def _usable(address: object) -> bool:
    """True for `(AF_INET, (ipv4, port))` or `(AF_INET6, (ipv6, port[, flowinfo, scope_id]))`."""
    if not (isinstance(address, tuple) and len(address) == 2):
        return False
    family, sockaddr = address
    version = {socket.AF_INET: (4, (2,)), socket.AF_INET6: (6, (2, 4))}.get(family)
    if version is None or not isinstance(sockaddr, tuple) or len(sockaddr) not in version[1]:
        return False
    ip, port, *rest = sockaddr
    if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
        return False
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**32 for n in rest):
        return False
    try:
        return isinstance(ip, str) and ipaddress.ip_address(ip).version == version[0]
    except ValueError:
        return False


def _forget_lookup(
    loop: asyncio.AbstractEventLoop, key: _Key, done: asyncio.Task[list[Address]]
) -> None:
    _lookups.pop((loop, key), None)
    if not done.cancelled():
        done.exception()  # retrieved: every waiter may have gone (cancelled) before it ended


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
        raise_if_out_of_files(exc, origin)
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


def raise_if_out_of_files(exc: OSError, origin: str) -> None:
    if exc.errno in _NO_FILES:
        raise OpenFilesExhausted(
            f"The process ran out of file descriptors opening a connection to {origin} "
            f"({errno.errorcode[exc.errno]}); raise the limit (ulimit -n) or lower the "
            "number of concurrent passes.",
            url=origin,
        ) from None
