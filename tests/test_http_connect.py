"""Reaching a server: hosts (IDNA 2008, literals), routes, and proxies chosen and spoken to.

Real parts only: servers and a CONNECT proxy (`treadle.testing.fake_proxy`) on 127.0.0.1;
httpx, the reference, runs in the same tests where they agree. TLS is in
test_http_connect_tls.py, dialing (Happy Eyeballs, DNS, EMFILE) in test_http_connect_dial.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl

import httpx
import pytest
import trustme

from connect_helpers import (
    NO_ENV,
    Collect,
    body,
    exchange,
    serve,
    server_context,
    tcp_server,
)
from treadle._http.connect import (
    NetworkOptions,
    open_connection,
    route_for,
)
from treadle._http.errors import (
    ConnectTimeout,
    InvalidURL,
    ProxyError,
)
from treadle.testing.fake_proxy import FakeProxy

# The test CA (`ca`, `ca_file`) and the clean environment come from conftest.py.
pytestmark = pytest.mark.usefixtures("clean_network")


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


async def test_one_kept_alive_proxy_connection_carries_requests_to_two_origins() -> None:
    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        name = f"{writer.get_extra_info('sockname')[1]}".encode()
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(name), name))
            await writer.drain()

    proxy = FakeProxy(auth=("u", "p"))
    await proxy.start_serving()
    try:
        async with tcp_server(keep_alive) as one, tcp_server(keep_alive) as two:
            options = NetworkOptions(proxy=proxy.url, trust_env=False)
            first = route_for(f"http://127.0.0.1:{one}/", options)
            transport, protocol = await open_connection(
                first, Collect, options=options, connect_timeout=30
            )
            try:
                for port in (one, two, one):
                    route = route_for(f"http://127.0.0.1:{port}/", options)
                    assert route.proxy == first.proxy  # the same proxy connection serves both
                    head = [f"GET {route.origin}/v1 HTTP/1.1", f"Host: {route.authority}"]
                    head += [f"{name}: {value}" for name, value in route.proxy_headers]
                    protocol.data.clear()
                    transport.write(("\r\n".join(head) + "\r\n\r\n").encode())
                    await protocol.until(b"\r\n\r\n" + str(port).encode())
            finally:
                transport.close()
        assert [r.target for r in proxy.requests] == [
            f"http://127.0.0.1:{port}/v1" for port in (one, two, one)
        ]
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
