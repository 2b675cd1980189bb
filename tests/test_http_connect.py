"""Reaching a server as users' networks need it: proxies, TLS, Happy Eyeballs, IDNA, EMFILE.

Real parts only: servers, a CONNECT proxy (`treadle.testing.fake_proxy`) and a black-holed
address all live on 127.0.0.x; httpx, the reference, runs in the same tests where they agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from treadle._http.connect import (
    Address,
    NetworkOptions,
    Resolver,
    Route,
    open_connection,
    route_for,
)
from treadle._http.errors import (
    ConnectError,
    ConnectTimeout,
    InvalidURL,
    ProxyError,
    TLSError,
)
from treadle.testing.fake_proxy import FakeProxy, TLSFront

ROOT = Path(__file__).resolve().parent.parent
NO_ENV = NetworkOptions(trust_env=False)


class Collect(asyncio.Protocol):
    """Records what the connection delivers; `closed` resolves when it ends."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.made = 0
        self.transport: asyncio.BaseTransport | None = None
        self.closed: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made += 1
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


async def exchange(
    route: Route, options: NetworkOptions, *, budget: float = 30.0, **kw: object
) -> bytes:
    """One GET over a fresh connection to `route`; the reply's bytes up to the server's close."""
    transport, protocol = await open_connection(
        route,
        Collect,
        options=options,
        connect_timeout=budget,
        **kw,  # type: ignore[arg-type]
    )
    assert protocol.made == 1 and protocol.transport is transport
    target = f"{route.origin}/probe" if route.absolute_form else "/probe"
    head = [f"GET {target} HTTP/1.1", f"Host: {route.authority}", "Connection: close"]
    if route.absolute_form:
        head += [f"{name}: {value}" for name, value in route.proxy_headers]
    transport.write(("\r\n".join(head) + "\r\n\r\n").encode())
    try:
        await asyncio.wait_for(asyncio.shield(protocol.closed), 30)
    finally:
        transport.close()
    return bytes(protocol.data)


def body(reply: bytes) -> bytes:
    return reply.partition(b"\r\n\r\n")[2]


@dataclass
class Origin:
    """A test server: its URL and what it saw."""

    url: str
    port: int
    hosts: list[str]
    alpn: list[str | None]


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Origin) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        writer.close()
        return
    for line in head.decode("latin-1").split("\r\n"):
        if line.lower().startswith("host:"):
            seen.hosts.append(line[5:].strip())
    tls = writer.get_extra_info("ssl_object")
    seen.alpn.append(tls.selected_alpn_protocol() if tls is not None else None)
    payload = b"hello from " + (b"tls" if tls is not None else b"plain")
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(payload), payload)
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def tcp_server(
    handler: Handler, host: str = "127.0.0.1", context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """A server on `host` whose every connection and handler ends when the block does.

    (Python 3.11's `Server.close()` leaves accepted connections open.)
    """
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        writers.append(writer)
        with contextlib.suppress(ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            await handler(reader, writer)

    server = await asyncio.start_server(tracked, host, 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()  # the handlers see the connection end and return
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=10)
            for task in stuck:
                task.cancel()
        await server.wait_closed()
        await asyncio.sleep(0)  # lets the aborted transports finish closing


@contextlib.asynccontextmanager
async def serve(
    context: ssl.SSLContext | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[Origin]:
    scheme = "https" if context is not None else "http"
    seen = Origin("", 0, [], [])
    async with tcp_server(lambda r, w: _answer(r, w, seen), host, context) as port:
        seen.port = port
        shown = f"[{host}]" if ":" in host else host
        seen.url = f"{scheme}://{shown}:{port}"
        yield seen


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA) -> Iterator[str]:
    with ca.cert_pem.tempfile() as path:
        yield path


def server_context(ca: trustme.CA, *, require_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1", "::1").configure_cert(context)
    context.set_alpn_protocols(["h2", "http/1.1"])
    if require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    return context


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's or CI's own proxy settings must not leak into these tests.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)


# -- hosts: IDNA 2008 and literals, as httpx encodes them -----------------------------------

HOSTS = [
    "faß.de",
    "FAß.DE",
    "bücher.example",
    "xn--fa-hia.de",
    "example.com.",
    "Example.COM",
    "ドメイン.テスト",
    "☃.net",
    "a\u200db.com",
    "-bad-.example",
    "xn--zz.com",
    "256.1.1.1",
    "1.2.3.4",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "[::g]",
    "e\u0301xample.com",
]


@pytest.mark.parametrize("host", HOSTS)
def test_a_host_is_encoded_as_httpx_encodes_it_and_refused_where_httpx_refuses(host: str) -> None:
    url = f"https://{host}:8443/v1"
    try:
        expected: str | None = httpx.URL(url).raw_host.decode("ascii")
    except httpx.InvalidURL:
        expected = None
    try:
        ours: str | None = route_for(url, NO_ENV).host
    except InvalidURL as exc:
        assert host.strip("[]") in str(exc) or repr(host) in str(exc)
        ours = None
    if expected is None:
        assert ours is None, f"httpx refuses {host!r}, Treadle sent {ours!r}"
    else:
        assert ours == expected


def test_idna_2008_not_2003() -> None:
    assert route_for("https://faß.de/", NO_ENV).host == "xn--fa-hia.de"  # IDNA 2003: fass.de


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.com/", "http"),
        ("https:///v1", "no host"),
        ("https://exa mple.com/", "not a valid host"),
        ("https://example.com:99999/", "(?i)port"),
        ("http://[::1/", "malformed"),
        ("https://a..b/", "not a valid host"),
    ],
)
def test_bad_urls_are_invalid_url_with_a_reason(url: str, why: str) -> None:
    with pytest.raises(InvalidURL, match=why):
        route_for(url, NO_ENV)


def test_route_is_hashable_and_keeps_proxy_credentials_out_of_its_repr() -> None:
    options = NetworkOptions(proxy="http://alice:s3cret@127.0.0.1:3128", trust_env=False)
    plain = route_for("http://api.example/v1", options)
    assert plain.proxy == "http://127.0.0.1:3128" and plain.absolute_form
    assert dict(plain.proxy_headers) == {"Proxy-Authorization": "Basic YWxpY2U6czNjcmV0"}
    assert "s3cret" not in repr(plain) and "YWxp" not in repr(plain)
    tls = route_for("https://api.example/v1", options)
    assert not tls.absolute_form and tls.proxy == plain.proxy
    assert {plain, tls, route_for("http://api.example/v2", options)} == {plain, tls}
    ipv6 = route_for("http://[::1]:8080/", NO_ENV)
    assert (ipv6.host, ipv6.authority, ipv6.origin) == ("::1", "[::1]:8080", "http://[::1]:8080")
    assert route_for("https://h.example:443/", NO_ENV).authority == "h.example"


def test_messages_never_carry_credentials_of_a_bad_url() -> None:
    for url in ("http://u:hunter22@proxy:99999", "http://u:hunter22@[::1/", "ftp://u:hunter22@h"):
        with pytest.raises(InvalidURL) as caught:
            NetworkOptions(proxy=url)
        assert "hunter22" not in str(caught.value), caught.value
        with pytest.raises(InvalidURL) as caught:
            route_for(url.replace("proxy", "api"), NO_ENV)
        assert "hunter22" not in str(caught.value), caught.value


def test_unsupported_proxies_and_options_fail_at_construction() -> None:
    with pytest.raises(InvalidURL, match="SOCKS"):
        NetworkOptions(proxy="socks5://127.0.0.1:1080")
    with pytest.raises(InvalidURL, match="proxy URL"):
        NetworkOptions(proxy="ftp://127.0.0.1:21")
    with pytest.raises(ValueError, match="verify="):
        NetworkOptions(verify=3)  # type: ignore[arg-type]


# -- proxies chosen from the environment, as httpx chooses them ------------------------------

ENVIRONMENTS: list[dict[str, str]] = [
    {"HTTPS_PROXY": "http://p-https:1"},
    {"HTTP_PROXY": "http://p-http:2", "HTTPS_PROXY": "p-bare:3"},
    {"ALL_PROXY": "http://p-all:4", "HTTPS_PROXY": "http://p-https:1"},
    {"ALL_PROXY": "http://p-all:4", "NO_PROXY": "example.com"},
    {"ALL_PROXY": "http://p-all:4", "NO_PROXY": ".example.com, localhost"},
    {"ALL_PROXY": "http://p-all:4", "NO_PROXY": "*"},
    {"ALL_PROXY": "http://p-all:4", "NO_PROXY": "api.example.com:8443,10.1.2.3,::1"},
    {"all_proxy": "http://lower:5", "ALL_PROXY": "http://upper:6", "no_proxy": "internal"},
    {"HTTPS_PROXY": "http://u:p@p-auth:7", "NO_PROXY": "https://example.com"},
]
URLS = [
    "https://example.com/v1",
    "http://example.com/v1",
    "https://api.example.com/v1",
    "https://api.example.com:8443/v1",
    "https://notexample.com/v1",
    "http://localhost:8000/v1",
    "http://10.1.2.3/v1",
    "http://[::1]:8000/v1",
    "https://bücher.example/v1",
    "https://svc.internal/v1",
    "https://internal/v1",
]


def httpx_proxy(url: str) -> str | None:
    """The proxy httpx's own selection code picks for `url` (its mounts, most specific first)."""
    from httpx._utils import URLPattern, get_environment_proxies

    mounts = sorted((URLPattern(k), v) for k, v in get_environment_proxies().items())
    for pattern, proxy in mounts:
        if pattern.matches(httpx.URL(url)):
            if proxy is None:
                return None
            parsed = httpx.URL(proxy)
            return f"{parsed.scheme}://{parsed.host}:{parsed.port}"
    return None


@pytest.mark.parametrize(
    "env", ENVIRONMENTS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items())
)
def test_environment_proxies_match_httpx(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for url in URLS:
        ours = route_for(url, NetworkOptions()).proxy
        assert ours == httpx_proxy(url), url
        assert route_for(url, NO_ENV).proxy is None  # trust_env=False ignores all of it


def test_no_proxy_with_an_idna_name_in_either_form(monkeypatch: pytest.MonkeyPatch) -> None:
    # httpx raises InvalidURL while building its mounts for a Unicode NO_PROXY entry; Treadle
    # matches the entry against the host as written and as sent.
    monkeypatch.setenv("ALL_PROXY", "http://p-all:4")
    for entry in ("bücher.example", "xn--bcher-kva.example"):
        monkeypatch.setenv("NO_PROXY", entry)
        for url in ("https://bücher.example/", "https://api.bücher.example/"):
            assert route_for(url, NetworkOptions()).proxy is None, (entry, url)
        assert route_for("https://other.example/", NetworkOptions()).proxy == "http://p-all:4"
    monkeypatch.setenv("NO_PROXY", "xn--bcher-kva.example")
    assert route_for("https://xn--bcher-kva.example/", NetworkOptions()).proxy is None


def test_explicit_proxy_wins_over_environment_and_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://env-proxy:1")
    monkeypatch.setenv("NO_PROXY", "*")
    route = route_for("https://x.example/", NetworkOptions(proxy="http://explicit:2"))
    assert route.proxy == "http://explicit:2"


# -- through a real CONNECT proxy --------------------------------------------------------------


async def test_https_through_a_connect_tunnel_with_credentials_as_httpx(
    ca: trustme.CA, ca_file: str
) -> None:
    proxy = FakeProxy(auth=("alice", "s3cret"))
    await proxy.start_serving()
    try:
        async with serve(server_context(ca)) as origin:
            url = f"https://localhost:{origin.port}/v1"
            options = NetworkOptions(proxy=proxy.url, verify=ca_file, trust_env=False)
            route = route_for(url, options)
            reply = await exchange(route, options)
            assert body(reply) == b"hello from tls"
            assert origin.alpn == ["http/1.1"]  # offered ALPN, and the server chose it
            verify = ssl.create_default_context(cafile=ca_file)
            async with httpx.AsyncClient(proxy=proxy.url, verify=verify, trust_env=False) as c:
                assert (await c.get(url)).content == b"hello from tls"
            ours, theirs = proxy.requests
            assert ours == theirs  # same CONNECT target, same Proxy-Authorization
            assert ours.method == "CONNECT" and ours.target == f"localhost:{origin.port}"
            assert origin.hosts[0] == origin.hosts[1] == f"localhost:{origin.port}"
    finally:
        await proxy.stop_serving()


async def test_an_https_proxy_speaks_tls_to_the_proxy_then_to_the_origin_inside_it(
    ca: trustme.CA, ca_file: str
) -> None:
    proxy = FakeProxy(ssl=server_context(ca), auth=("carol", "pw"))
    await proxy.start_serving()
    try:
        assert proxy.url.startswith("https://")
        options = NetworkOptions(proxy=proxy.url, verify=ca_file, trust_env=False)
        async with serve(server_context(ca)) as tls_origin, serve() as plain_origin:
            route = route_for(f"https://localhost:{tls_origin.port}/", options)
            assert body(await exchange(route, options)) == b"hello from tls"  # TLS in TLS
            route = route_for(f"{plain_origin.url}/", options)
            assert body(await exchange(route, options)) == b"hello from plain"
            verify = ssl.create_default_context(cafile=ca_file)
            mount = httpx.Proxy(proxy.url, ssl_context=verify)
            async with httpx.AsyncClient(proxy=mount, verify=verify, trust_env=False) as client:
                got = await client.get(f"https://localhost:{tls_origin.port}/")
                assert got.content == b"hello from tls"
        assert [r.method for r in proxy.requests] == ["CONNECT", "GET", "CONNECT"]
        assert proxy.requests[0] == proxy.requests[2]
    finally:
        await proxy.stop_serving()


async def test_a_proxy_that_never_answers_is_a_connect_timeout_and_leaks_nothing() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the CONNECT and never answers

    before = len(os.listdir("/proc/self/fd"))
    async with tcp_server(mute) as port:
        options = NetworkOptions(proxy=f"http://127.0.0.1:{port}", trust_env=False)
        route = route_for("https://localhost:1/", options)
        with pytest.raises(ConnectTimeout, match="through the proxy"):
            await exchange(route, options, budget=0.5)
    await asyncio.sleep(0)  # a closed transport releases its socket on the next turn
    assert len(os.listdir("/proc/self/fd")) == before  # the server's sockets and ours


async def test_plain_http_through_a_proxy_uses_absolute_form_as_httpx() -> None:
    proxy = FakeProxy(auth=("bob", "pa:ss/w@rd"))
    await proxy.start_serving()
    quoted = f"http://bob:{'pa%3Ass%2Fw%40rd'}@127.0.0.1:{proxy.port}"
    try:
        async with serve() as origin:
            options = NetworkOptions(proxy=quoted, trust_env=False)
            route = route_for(f"{origin.url}/v1", options)
            assert route.absolute_form
            assert body(await exchange(route, options)) == b"hello from plain"
            async with httpx.AsyncClient(proxy=quoted, trust_env=False) as client:
                assert (await client.get(f"{origin.url}/probe")).content == b"hello from plain"
            ours, theirs = proxy.requests
            assert ours.target == theirs.target == f"{origin.url}/probe"
            assert ours.proxy_authorization == theirs.proxy_authorization is not None
    finally:
        await proxy.stop_serving()


async def test_environment_proxy_and_no_proxy_bypass_as_httpx(
    ca: trustme.CA, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = FakeProxy()
    await proxy.start_serving()
    try:
        async with serve(server_context(ca)) as origin:
            monkeypatch.setenv("HTTPS_PROXY", proxy.url)
            monkeypatch.setenv("NO_PROXY", "localhost")
            options = NetworkOptions(verify=ca_file)
            verify = ssl.create_default_context(cafile=ca_file)
            async with httpx.AsyncClient(verify=verify) as client:
                for host, via_proxy in (("localhost", False), ("127.0.0.1", True)):
                    url = f"https://{host}:{origin.port}/v1"
                    before = len(proxy.requests)
                    route = route_for(url, options)
                    assert (route.proxy is not None) is via_proxy
                    assert body(await exchange(route, options)) == b"hello from tls"
                    mine = len(proxy.requests) - before
                    assert (await client.get(url)).content == b"hello from tls"
                    assert len(proxy.requests) - before == 2 * mine == (2 if via_proxy else 0)
    finally:
        await proxy.stop_serving()


async def test_a_refused_connect_is_a_proxy_error_naming_the_status_not_the_password(
    ca_file: str,
) -> None:
    proxy = FakeProxy(auth=("alice", "right"))
    await proxy.start_serving()
    try:
        wrong = f"http://alice:wr0ngpass@127.0.0.1:{proxy.port}"
        options = NetworkOptions(proxy=wrong, verify=ca_file, trust_env=False)
        with pytest.raises(ProxyError, match="407") as caught:
            await exchange(route_for("https://localhost:1/v1", options), options)
        assert "wr0ngpass" not in str(caught.value) and "alice" not in str(caught.value)
        good = NetworkOptions(proxy=proxy.url, verify=ca_file, trust_env=False)
        with pytest.raises(ProxyError, match="403"):  # this proxy tunnels to loopback only
            await exchange(route_for("https://example.com/v1", good), good)
    finally:
        await proxy.stop_serving()


async def test_an_unreachable_or_misbehaving_proxy_is_a_proxy_error() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens here now: connection refused
    options = NetworkOptions(proxy=f"http://u:hunter22@127.0.0.1:{port}", trust_env=False)
    with pytest.raises(ProxyError, match="Cannot reach the proxy") as caught:
        await exchange(route_for("https://localhost:1/", options), options)
    assert "hunter22" not in str(caught.value)

    replies = {
        "malformed": b"HTTP/1.1 2000 OK\r\n\r\n",  # llhttp refuses a 4-digit status
        "over 65536 bytes": b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70_000,
        "sent bytes after its 200 reply": b"HTTP/1.1 200 OK\r\n\r\nSSH-2.0-not-a-tunnel\r\n",
        "closed the connection before answering": b"HTTP/1.1 200 OK\r\n",
    }
    for why, reply in replies.items():

        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)  # noqa: B023 (each server lives only in its own iteration)
            await writer.drain()
            writer.close()

        async with tcp_server(proxy) as port:
            options = NetworkOptions(proxy=f"http://127.0.0.1:{port}", trust_env=False)
            with pytest.raises(ProxyError, match=why):
                await exchange(route_for("https://localhost:1/", options), options)


# -- TLS: trust, client certificates, the connect budget -------------------------------------


async def test_trust_certifi_by_default_ssl_cert_file_when_trust_env_and_verify_options(
    ca: trustme.CA, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(server_context(ca)) as origin:
        route = route_for(f"https://localhost:{origin.port}/", NO_ENV)
        with pytest.raises(TLSError, match="did not verify") as caught:
            await exchange(route, NetworkOptions())  # certifi does not know the test CA
        assert not caught.value.plaintext_peer
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(f"https://localhost:{origin.port}/")
        monkeypatch.setenv("SSL_CERT_FILE", ca_file)
        assert body(await exchange(route, NetworkOptions())) == b"hello from tls"
        async with httpx.AsyncClient() as client:  # httpx reads it the same way
            assert (await client.get(f"https://localhost:{origin.port}/")).status_code == 200
        with pytest.raises(TLSError):
            await exchange(route, NetworkOptions(trust_env=False))  # env ignored
        monkeypatch.delenv("SSL_CERT_FILE")
        for verify in (
            ca_file,
            str(Path(ca_file).parent / _hashed_dir(ca_file)),
            ssl.create_default_context(cafile=ca_file),
            False,
        ):
            got = await exchange(route, NetworkOptions(verify=verify, trust_env=False))
            assert body(got) == b"hello from tls", verify


def _hashed_dir(ca_file: str) -> str:
    """A CA directory as OpenSSL's capath wants it (`<subject hash>.0`), next to `ca_file`."""
    digest = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", ca_file],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    directory = Path(ca_file).parent / f"cadir-{Path(ca_file).stem}"
    directory.mkdir(exist_ok=True)
    (directory / f"{digest}.0").write_bytes(Path(ca_file).read_bytes())
    return directory.name


async def test_ssl_cert_dir_is_read_when_trust_env(
    ca: trustme.CA, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_DIR", str(Path(ca_file).parent / _hashed_dir(ca_file)))
    async with serve(server_context(ca)) as origin:
        route = route_for(f"https://localhost:{origin.port}/", NO_ENV)
        assert body(await exchange(route, NetworkOptions())) == b"hello from tls"


async def test_client_certificates_for_a_server_that_requires_one(
    ca: trustme.CA, ca_file: str
) -> None:
    client = ca.issue_cert("client.example")
    async with serve(server_context(ca, require_client_cert=True)) as origin:
        route = route_for(f"https://localhost:{origin.port}/", NO_ENV)
        with (
            client.private_key_and_cert_chain_pem.tempfile() as both,
            client.cert_chain_pems[0].tempfile() as cert,
            client.private_key_pem.tempfile() as key,
        ):
            for pem in (both, (cert, key)):
                options = NetworkOptions(verify=ca_file, cert=pem, trust_env=False)
                assert body(await exchange(route, options)) == b"hello from tls"
        # Without one: TLS 1.3 may finish the client's side of the handshake before the server
        # checks, so the refusal is either a TLSError or a connection that ends with no reply.
        try:
            got = await exchange(route, NetworkOptions(verify=ca_file, trust_env=False))
        except TLSError:
            got = b""
        assert got == b""
        verify = ssl.create_default_context(cafile=ca_file)
        async with httpx.AsyncClient(verify=verify, trust_env=False) as plain:
            with pytest.raises(httpx.TransportError):
                await plain.get(f"https://localhost:{origin.port}/")


async def test_verify_system_uses_the_os_store_through_truststore(
    ca: trustme.CA, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("truststore")
    system = NetworkOptions(verify="system", trust_env=False)
    async with serve(server_context(ca)) as origin:
        route = route_for(f"https://localhost:{origin.port}/", NO_ENV)
        with pytest.raises(TLSError, match="did not verify"):
            await exchange(route, system)  # the test CA is in no OS store
        # OpenSSL's own SSL_CERT_FILE points the "system" store at the test CA: truststore reads
        # the store at each handshake, so the same cached context now trusts it.
        monkeypatch.setenv("SSL_CERT_FILE", ca_file)
        assert body(await exchange(route, system)) == b"hello from tls"
        assert origin.alpn[-1] == "http/1.1"


def test_verify_system_without_truststore_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from treadle._http import tls
    from treadle._http.connect import ssl_context
    from treadle.errors import ConfigurationError

    monkeypatch.setattr(tls, "_built", {})  # no context cached by an earlier test
    monkeypatch.setitem(sys.modules, "truststore", None)  # as if the extra were not installed
    with pytest.raises(ConfigurationError, match=r"treadle\[truststore\]"):
        ssl_context(NetworkOptions(verify="system"))


async def test_mutual_tls_in_front_of_the_fake_openai_server(ca: trustme.CA, ca_file: str) -> None:
    from treadle.testing import FakeOpenAIServer

    client = ca.issue_cert("client.example")
    server = FakeOpenAIServer(script="echo")
    await server.start_serving()
    front = TLSFront(server.port, ssl=server_context(ca, require_client_cert=True))
    await front.start_serving()
    try:
        with client.private_key_and_cert_chain_pem.tempfile() as pem:
            options = NetworkOptions(verify=ca_file, cert=pem, trust_env=False)
            route = route_for(f"{front.url}/v1/chat/completions", options)
            transport, protocol = await open_connection(
                route, Collect, options=options, connect_timeout=30
            )
            payload = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
            transport.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (route.authority.encode(), len(payload), payload)
            )
            await asyncio.wait_for(asyncio.shield(protocol.closed), 30)
            transport.close()
            assert protocol.data.startswith(b"HTTP/1.1 200") and b"hi" in protocol.data
    finally:
        await front.stop_serving()
        await server.stop_serving()


def test_missing_certificate_files_are_a_configuration_error(tmp_path: Path) -> None:
    from treadle._http.connect import ssl_context
    from treadle.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="Cannot load the certificates"):
        ssl_context(NetworkOptions(verify=str(tmp_path / "nope.pem"), trust_env=False))
    with pytest.raises(ConfigurationError, match="Cannot load the certificates"):
        ssl_context(NetworkOptions(cert=str(tmp_path / "nope.pem"), trust_env=False))


async def test_a_burst_of_first_connections_builds_one_context(
    ca: trustme.CA, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from treadle._http import tls

    builds: list[object] = []
    real = tls._build_context

    def counted(*args: Any) -> ssl.SSLContext:
        builds.append(args)
        return real(*args)

    monkeypatch.setattr(tls, "_build_context", counted)  # a spy: the real build still runs
    monkeypatch.setattr(tls, "_built", {})  # nothing cached by an earlier test
    # certifi's bundle (about 150 CAs, milliseconds to load): the test CA is not in it, so each
    # connection fails to verify, after sharing the one context.
    options = NetworkOptions(trust_env=False)
    async with serve(server_context(ca)) as origin:
        route = route_for(f"https://localhost:{origin.port}/", options)
        failures = await asyncio.gather(
            *(exchange(route, options) for _ in range(40)), return_exceptions=True
        )
    assert {type(failure) for failure in failures} == {TLSError}
    assert len(builds) == 1


def test_ssl_context_is_cached_per_options_and_offers_http11(ca_file: str) -> None:
    from treadle._http.connect import ssl_context

    one = ssl_context(NetworkOptions(verify=ca_file))
    assert ssl_context(NetworkOptions(verify=ca_file)) is one
    assert ssl_context(NetworkOptions(verify=False)) is not one
    assert one.verify_mode == ssl.CERT_REQUIRED and one.check_hostname


async def test_a_silent_tls_peer_is_a_connect_timeout_never_plain_http() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the ClientHello and never answers
        writer.close()

    async with tcp_server(silent) as port:
        url = f"https://127.0.0.1:{port}/"
        with pytest.raises(ConnectTimeout, match="connect timeout"):
            await exchange(route_for(url, NO_ENV), NetworkOptions(verify=False), budget=0.5)


async def test_a_handshake_slower_than_half_the_budget_still_connects(ca: trustme.CA) -> None:
    # The old lane gave TLS half the connect timeout and then said "use http://". The server
    # here accepts the TCP connection only after 60% of the budget, so the handshake ends late.
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    budget = 4.0

    async def late_tls() -> None:
        await asyncio.sleep(budget * 0.6)
        conn, _ = await loop.sock_accept(listener)
        seen = Origin("", 0, [], [])
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_accepted_socket(
            lambda: asyncio.StreamReaderProtocol(reader), conn, ssl=server_context(ca)
        )
        protocol = transport.get_protocol()
        assert isinstance(protocol, asyncio.StreamReaderProtocol)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        await _answer(reader, writer, seen)

    server = asyncio.create_task(late_tls())
    try:
        route = route_for(f"https://127.0.0.1:{listener.getsockname()[1]}/", NO_ENV)
        got = await exchange(route, NetworkOptions(verify=False), budget=budget)
        assert body(got) == b"hello from tls"
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        listener.close()


async def test_plaintext_peer_only_when_the_peer_answered_in_plain_http() -> None:
    async def plain_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # any bytes: a plain HTTP server answers a ClientHello with 400
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    async def ssh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # not TLS either, but not HTTP: no "use http://" for this one
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\nProtocol mismatch.\r\n")
        await writer.drain()
        await reader.read()
        writer.close()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    cases = [(plain_http, True, "plain HTTP"), (ssh, False, "not TLS"), (hang_up, False, "closed")]
    for handler, plaintext, says in cases:
        async with tcp_server(handler) as port:
            url = f"https://127.0.0.1:{port}/"
            with pytest.raises(TLSError, match=says) as caught:
                await exchange(route_for(url, NO_ENV), NetworkOptions(verify=False))
            assert caught.value.plaintext_peer is plaintext, caught.value


# -- connecting: Happy Eyeballs, resolving afresh, DNS failures, IPv6 ------------------------


@contextlib.contextmanager
def black_hole(port: int) -> Iterator[str]:
    """127.0.0.2:`port` drops every SYN: a listener whose accept queue is full.

    Linux drops a SYN for a listener with a full accept queue and the client retransmits it,
    as with a host that has gone away; the fillers are never accepted.
    """
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.2", port))
    listener.listen(0)
    fillers: list[socket.socket] = []
    try:
        for _ in range(8):
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.5)
            try:
                filler.connect(("127.0.0.2", port))
            except TimeoutError:
                break  # this SYN was dropped: the queue is full
        else:
            pytest.skip("this kernel does not drop SYNs to a full accept queue")
        yield "127.0.0.2"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def fixed(*addresses: tuple[str, int]) -> Resolver:
    """A resolver that answers every name with `addresses`, in that order."""

    async def resolve(host: str, port: int) -> list[Address]:
        return [(socket.AF_INET, address) for address in addresses]

    return resolve


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


def test_addresses_alternate_families_starting_with_the_resolvers_first_choice() -> None:
    from treadle._http.dial import _interleave

    v6 = [(socket.AF_INET6, (f"2001:db8::{i}", 443, 0, 0)) for i in (1, 2, 3)]
    v4 = [(socket.AF_INET, (f"192.0.2.{i}", 443)) for i in (1, 2)]
    mixed: list[Address] = [*v6, *v4]
    assert _interleave(mixed) == [v6[0], v4[0], v6[1], v4[1], v6[2]]
    v4_first: list[Address] = [v4[0], *v6, v4[1]]
    assert _interleave(v4_first) == [v4[0], v6[0], v4[1], v6[1], v6[2]]


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
