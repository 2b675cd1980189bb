"""Dialing: Happy Eyeballs past a black-holed address, one DNS lookup per burst and again
after a failure, DNS failures, IPv6 literals, cancellation, and EMFILE under a low `ulimit -n`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from connect_helpers import (
    NO_ENV,
    ROOT,
    Collect,
    black_hole,
    body,
    exchange,
    fixed,
    serve,
)
from treadle._http.connect import (
    Address,
    open_connection,
    route_for,
)
from treadle._http.errors import (
    ConnectError,
    ConnectTimeout,
)

# -- connecting: Happy Eyeballs, resolving afresh, DNS failures, IPv6 ------------------------


async def test_happy_eyeballs_connects_through_the_next_address_when_the_first_is_black_holed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serve() as origin:
        with black_hole(origin.port) as dead:
            # The black hole alone: nothing answers within the budget.
            route = route_for(f"http://{dead}:{origin.port}/", NO_ENV)
            with pytest.raises(ConnectTimeout):
                await exchange(route, NO_ENV, budget=1.0)
            # A name resolving to the black hole first and 127.0.0.1 second. Only the name
            # service is stood in for (this machine's resolver cannot be changed); Treadle and
            # httpx (anyio) both ask the loop's getaddrinfo, and both connect through the second
            # address 250 ms later, well inside a 30 s budget.
            loop = asyncio.get_running_loop()
            system = loop.getaddrinfo

            async def two_addresses(host: Any, port: Any, **kw: Any) -> Any:
                if host in ("api.test", b"api.test"):
                    addresses = [(dead, origin.port), ("127.0.0.1", origin.port)]
                    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", a) for a in addresses]
                return await system(host, port, **kw)

            monkeypatch.setattr(loop, "getaddrinfo", two_addresses)
            named = route_for(f"http://api.test:{origin.port}/", NO_ENV)
            assert body(await exchange(named, NO_ENV)) == b"hello from plain"
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                got = await client.get(f"http://api.test:{origin.port}/")
                assert got.content == b"hello from plain"
            # The same through an injected resolver (`open_connection(resolver=...)`).
            resolver = fixed((dead, origin.port), ("127.0.0.1", origin.port))
            assert body(await exchange(named, NO_ENV, resolver=resolver)) == b"hello from plain"


async def test_a_failed_connect_resolves_again_so_a_fail_over_is_seen_at_once() -> None:
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    dead_port = refused.getsockname()[1]
    refused.close()
    async with serve() as origin:
        calls: list[str] = []
        answers: Iterator[list[Address]] = iter(
            [
                [(socket.AF_INET, ("127.0.0.1", dead_port))],
                [(socket.AF_INET, ("127.0.0.1", origin.port))],
            ]
        )

        async def resolver(host: str, port: int) -> list[Address]:
            calls.append(host)
            return next(answers)

        route = route_for(f"http://api.test:{origin.port}/", NO_ENV)
        with pytest.raises(ConnectError, match="Cannot connect") as caught:
            await exchange(route, NO_ENV, resolver=resolver)
        assert not caught.value.dns
        assert body(await exchange(route, NO_ENV, resolver=resolver)) == b"hello from plain"
        assert calls == ["api.test", "api.test"]


async def test_a_burst_of_connections_to_one_name_makes_one_lookup() -> None:
    async with serve() as origin:
        calls: list[str] = []
        asked, release = asyncio.Event(), asyncio.Event()

        async def slow_resolver(host: str, port: int) -> list[Address]:
            calls.append(host)
            asked.set()
            await release.wait()  # every connection of the burst is waiting by now
            return [(socket.AF_INET, ("127.0.0.1", origin.port))]

        route = route_for(f"http://burst.test:{origin.port}/", NO_ENV)
        burst = [
            asyncio.create_task(exchange(route, NO_ENV, resolver=slow_resolver)) for _ in range(20)
        ]
        await asyncio.wait_for(asked.wait(), 30)
        for _ in range(5):
            await asyncio.sleep(0)  # turns of the loop: the rest of the burst reaches the lookup
        release.set()
        assert {body(reply) for reply in await asyncio.gather(*burst)} == {b"hello from plain"}
        # A later connection reuses the answer (kept DNS_CACHE_SECONDS; dropped on failure).
        assert body(await exchange(route, NO_ENV, resolver=slow_resolver)) == b"hello from plain"
        assert calls == ["burst.test"]


async def test_a_name_that_does_not_resolve_is_a_dns_connect_error() -> None:
    async def nxdomain(host: str, port: int) -> list[Address]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    route = route_for("https://no-such-host.test/", NO_ENV)
    with pytest.raises(ConnectError, match="did not resolve") as caught:
        await exchange(route, NO_ENV, resolver=nxdomain)
    assert caught.value.dns


async def test_the_system_resolver_failing_is_a_dns_connect_error_as_in_httpx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()

    async def nxdomain(host: Any, port: Any, **kw: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(loop, "getaddrinfo", nxdomain)  # no DNS query leaves the machine
    with pytest.raises(ConnectError, match="did not resolve") as caught:
        await exchange(route_for("https://no-such-host.test/", NO_ENV), NO_ENV)
    assert caught.value.dns
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.ConnectError, match="Name or service not known"):
            await client.get("https://no-such-host.test/")


async def test_unusable_resolver_entries_are_skipped_and_a_good_one_still_connects() -> None:
    async with serve() as origin:
        good = (socket.AF_INET, ("127.0.0.1", origin.port))
        hostile: list[Any] = [
            (socket.AF_INET, ("127.0.0.1", 70000)),  # OverflowError in connect
            (socket.AF_UNIX, ("/tmp/nothing",)),  # TypeError in the race (ExceptionGroup)
            (socket.AF_INET, ("127.0.0.1",)),  # a short sockaddr
            (socket.AF_INET6, ("127.0.0.1", origin.port)),  # family and address disagree
            (socket.AF_INET, (b"127.0.0.1", origin.port)),
            "127.0.0.1",
            None,
        ]
        for bad in hostile:

            async def resolver(host: str, port: int, bad: Any = bad) -> list[Any]:
                return [bad, good]

            route = route_for(f"http://hostile.test:{origin.port}/", NO_ENV)
            reply = await exchange(route, NO_ENV, resolver=resolver)
            assert body(reply) == b"hello from plain", bad


@pytest.mark.parametrize(
    "answer",
    [
        [],
        [(socket.AF_INET, ("127.0.0.1", 70000))],
        [(socket.AF_INET, ("127.0.0.1",)), (socket.AF_UNIX, ("/tmp/nothing",))],
        None,
        RuntimeError("resolver bug"),
        ValueError("resolver bug"),
    ],
)
async def test_a_resolver_that_fails_or_answers_nothing_usable_is_a_dns_connect_error(
    answer: Any,
) -> None:
    async def resolver(host: str, port: int) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    route = route_for("http://hostile.test:8080/", NO_ENV)
    with pytest.raises(ConnectError, match=r"hostile\.test") as caught:
        await exchange(route, NO_ENV, resolver=resolver)
    assert caught.value.dns


def test_addresses_alternate_families_starting_with_the_resolvers_first_choice() -> None:
    from treadle._http.dial import _interleave

    v6 = [(socket.AF_INET6, (f"2001:db8::{i}", 443, 0, 0)) for i in (1, 2, 3)]
    v4 = [(socket.AF_INET, (f"192.0.2.{i}", 443)) for i in (1, 2)]
    mixed: list[Address] = [*v6, *v4]
    assert _interleave(mixed) == [v6[0], v4[0], v6[1], v4[1], v6[2]]
    v4_first: list[Address] = [v4[0], *v6, v4[1]]
    assert _interleave(v4_first) == [v4[0], v6[0], v4[1], v6[1], v6[2]]


def test_a_host_is_told_literal_or_name_once_with_the_same_answers() -> None:
    """Every new connection asks whether its host is an IP literal: the answer is kept per
    host (about 2.4 µs of `ipaddress` parsing a connection before), bounded like the DNS cache,
    and the same as the parse gives."""
    import ipaddress

    from treadle._http import dial

    dial._literals.clear()
    cases = {"127.0.0.1": socket.AF_INET, "::1": socket.AF_INET6, "api.test": None,
             "2001:db8::1": socket.AF_INET6, "10.0.0.256": None, "localhost": None}  # fmt: skip
    for _ in range(2):
        for host, family in cases.items():
            got = dial._literal(host, 443)
            if family is None:
                assert got is None
                with pytest.raises(ValueError):
                    ipaddress.ip_address(host)
            elif family == socket.AF_INET6:
                assert got == (family, (host, 443, 0, 0))
            else:
                assert got == (family, (host, 443))
    assert set(dial._literals) == set(cases)
    parse = ipaddress.ip_address
    try:
        ipaddress.ip_address = None  # type: ignore[assignment]  # a second parse would fail
        assert dial._literal("127.0.0.1", 8080) == (socket.AF_INET, ("127.0.0.1", 8080))
    finally:
        ipaddress.ip_address = parse
    for i in range(dial.MAX_CACHED_NAMES + 10):
        dial._literal(f"host-{i}.test", 443)
    assert len(dial._literals) <= dial.MAX_CACHED_NAMES


def test_a_host_longer_than_any_name_is_not_kept() -> None:
    # A hostile base URL's megabyte-long host, one per connection attempt, kept 256 MB alive.
    from treadle._http import dial

    dial._literals.clear()
    long = "a" * 100_000 + ".test"
    assert dial._literal(long, 443) is None
    assert dial._literal("b" * 253, 443) is None
    assert set(dial._literals) == {"b" * 253}


async def test_ipv6_literals_connect() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        async with serve(host="::1") as origin:
            route = route_for(f"{origin.url}/v1", NO_ENV)
            assert route.host == "::1"
            assert body(await exchange(route, NO_ENV)) == b"hello from plain"
            assert origin.hosts == [f"[::1]:{origin.port}"]
    except OSError as exc:  # no ::1 on this machine's loopback
        pytest.skip(f"no IPv6 loopback: {exc}")


async def test_cancelling_a_pending_connect_closes_every_socket() -> None:
    async with serve() as origin:
        with black_hole(origin.port) as dead:
            before = len(os.listdir("/proc/self/fd"))
            route = route_for(f"http://api.test:{origin.port}/", NO_ENV)
            resolver = fixed((dead, origin.port), (dead, origin.port), (dead, origin.port))
            task = asyncio.create_task(
                open_connection(
                    route, Collect, options=NO_ENV, connect_timeout=None, resolver=resolver
                )
            )
            await asyncio.sleep(0.6)  # lets the race start more than one attempt
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(os.listdir("/proc/self/fd")) == before


# -- EMFILE ------------------------------------------------------------------------------------

EMFILE_SCRIPT = textwrap.dedent(
    """
    import asyncio, contextlib, os, resource, socket, sys
    import certifi  # imported before the limit: an import opens files too
    from treadle._http.connect import NetworkOptions, open_connection, route_for
    from treadle._http.errors import OpenFilesExhausted

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    port, hole = int(sys.argv[1]), sys.argv[2]
    options = NetworkOptions(trust_env=False)

    async def hole_first(host, port):
        return [(socket.AF_INET, (hole, port)), (socket.AF_INET, ("127.0.0.1", port))]

    async def attempt(url, **kw):
        try:
            transport, _ = await open_connection(
                route_for(url, options), asyncio.Protocol, options=options,
                connect_timeout=30, **kw,
            )
        except OpenFilesExhausted as exc:
            return exc
        return transport

    async def main() -> None:
        held = []
        while len(held) < 200:
            got = await attempt(f"http://127.0.0.1:{port}/")
            if isinstance(got, OpenFilesExhausted):
                print("EXHAUSTED", len(held), got)
                break
            held.append(got)
        # One descriptor free: the black-holed first address takes it, the second attempt hits
        # EMFILE, and that ends the connect at once instead of waiting out the 30 s budget.
        held.pop().close()
        await asyncio.sleep(0.1)
        print("RACE", type(await attempt(f"http://api.test:{port}/", resolver=hole_first)).__name__)
        # Every descriptor taken: even resolving a name (glibc opens /etc/hosts) fails so.
        fillers = []
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        print("RESOLVER", type(await attempt(f"http://localhost:{port}/")).__name__)
        # One descriptor, taken by the socket or the CA bundle: a first TLS connection (the CA
        # file, OpenSSL's own files) says ulimit too, never "bad certificates" or "TLS failed".
        os.close(fillers.pop())
        print("CA", type(await attempt(f"https://127.0.0.1:{port}/")).__name__)
        for fd in fillers:
            os.close(fd)
        for transport in held:
            transport.close()
        await asyncio.sleep(0.1)  # lets the transports' close callbacks run
        print("RECOVERED", type(await attempt(f"http://localhost:{port}/")).__name__)

    asyncio.run(main())
    """
)


async def test_emfile_is_open_files_exhausted_naming_ulimit_and_the_process_recovers() -> None:
    async with serve() as origin:
        with black_hole(origin.port) as dead:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                EMFILE_SCRIPT,
                str(origin.port),
                dead,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            )
            out, err = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    lines = dict(line.split(" ", 1) for line in text.splitlines())
    assert "ulimit -n" in lines["EXHAUSTED"] and 0 < int(lines["EXHAUSTED"].split()[0]) < 64
    assert lines["RACE"] == "OpenFilesExhausted"
    assert lines["RESOLVER"] == "OpenFilesExhausted"
    assert lines["CA"] == "OpenFilesExhausted"
    assert lines["RECOVERED"] == "_SelectorSocketTransport"
