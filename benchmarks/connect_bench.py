"""Connecting: Treadle's `_http.connect` against asyncio's and httpx's own, in the same run.

Two measurements, interleaved per repetition so a busy machine weighs on every contestant alike:

- a name whose first address is black-holed (a 127.0.0.2 listener with a full accept queue, so
  its SYNs are dropped) and whose second is a live server on 127.0.0.1: the wall time until
  connected, for Treadle's Happy Eyeballs, asyncio's (`happy_eyeballs_delay=0.25`) and httpx's
  (anyio's). The old lane waited out the whole connect timeout here.
- a plain TCP connect and a TLS connect (certificate from `trustme`) to 127.0.0.1: wall
  microseconds per connection, Treadle against `asyncio.open_connection` and its ratio.

Only the name service is stood in for (the loop's `getaddrinfo`; this machine's resolver cannot
be changed); every connection is real. Never asserts on timing.
`python -m benchmarks.connect_bench [--repeat N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import trustme

from treadle._http.connect import NetworkOptions, Route, open_connection, route_for


@contextmanager
def _black_hole(port: int) -> Iterator[list[socket.socket]]:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.2", port))
    listener.listen(0)
    fillers: list[socket.socket] = [listener]
    try:
        for _ in range(8):
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.5)
            try:
                filler.connect(("127.0.0.2", port))
            except TimeoutError:
                break
        yield fillers
    finally:
        for sock in fillers:
            sock.close()


async def _server(context: ssl.SSLContext | None) -> tuple[asyncio.Server, int]:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers one request (httpx sends one), else holds the connection until the client
        # closes it (the bare connects).
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


async def _timed(make: Callable[[], Awaitable[Any]], close: Callable[[Any], None]) -> float:
    started = time.perf_counter()
    result = await make()
    elapsed = time.perf_counter() - started
    close(result)
    return elapsed


async def _timed_treadle(route: Route, options: NetworkOptions) -> float:
    """Seconds for one Treadle connection along `route` (closed at once)."""
    return await _timed(
        lambda: open_connection(route, asyncio.Protocol, options=options, connect_timeout=30),
        lambda pair: pair[0].close(),
    )


async def happy_eyeballs(repeat: int) -> dict[str, float]:
    """Median seconds to connect through a name whose first address is black-holed."""
    server, port = await _server(None)
    loop = asyncio.get_running_loop()
    system = loop.getaddrinfo

    async def two_addresses(host: Any, p: Any, **kw: Any) -> Any:
        if host in ("api.test", b"api.test"):
            pairs = [("127.0.0.2", port), ("127.0.0.1", port)]
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", pair) for pair in pairs]
        return await system(host, p, **kw)

    setattr(loop, "getaddrinfo", two_addresses)  # noqa: B010 (the name service stand-in)
    options = NetworkOptions(trust_env=False)
    route = route_for(f"http://api.test:{port}/", options)
    times: dict[str, list[float]] = {"treadle": [], "asyncio": [], "httpx": []}
    try:
        with _black_hole(port):
            async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                for _ in range(repeat):
                    times["treadle"].append(await _timed_treadle(route, options))
                    times["asyncio"].append(
                        await _timed(
                            lambda: loop.create_connection(
                                asyncio.Protocol, "api.test", port, happy_eyeballs_delay=0.25
                            ),
                            lambda pair: pair[0].close(),
                        )
                    )
                    # A new connection each time: a keep-alive one would skip connecting.
                    times["httpx"].append(
                        await _timed(
                            lambda: client.get(
                                f"http://api.test:{port}/", headers={"Connection": "close"}
                            ),
                            lambda reply: None,
                        )
                    )
    finally:
        loop.getaddrinfo = system  # type: ignore[method-assign]
        server.close()
    return {name: statistics.median(values) for name, values in times.items()}


async def connect_cost(repeat: int, tls: bool) -> dict[str, float]:
    """Median wall microseconds per connection to 127.0.0.1 (TCP, or TCP and TLS)."""
    context: ssl.SSLContext | None = None
    client_context: ssl.SSLContext | None = None
    ca = trustme.CA()
    if tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        client_context = ssl.create_default_context()
        ca.configure_trust(client_context)
    server, port = await _server(context)
    scheme = "https" if tls else "http"
    options = NetworkOptions(trust_env=False, verify=client_context or True)
    route = route_for(f"{scheme}://127.0.0.1:{port}/", options)
    times: dict[str, list[float]] = {"treadle": [], "asyncio": []}
    try:
        for _ in range(repeat):
            times["treadle"].append(await _timed_treadle(route, options))
            times["asyncio"].append(
                await _timed(
                    lambda: asyncio.open_connection("127.0.0.1", port, ssl=client_context),
                    lambda pair: pair[1].close(),
                )
            )
    finally:
        server.close()
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


async def main(repeat: int) -> None:
    he = await happy_eyeballs(max(3, repeat // 40))
    print("black-holed first address, median seconds to connect:")
    for name, seconds in he.items():
        print(f"  {name:8} {seconds:6.3f} s")
    for tls in (False, True):
        cost = await connect_cost(repeat, tls)
        kind = "TLS" if tls else "TCP"
        ratio = cost["treadle"] / cost["asyncio"]
        print(
            f"{kind} connect to 127.0.0.1, median: treadle {cost['treadle']:.0f} us, "
            f"asyncio.open_connection {cost['asyncio']:.0f} us, ratio {ratio:.2f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    asyncio.run(main(parser.parse_args().repeat))
