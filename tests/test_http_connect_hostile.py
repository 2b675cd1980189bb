"""What a hostile review of the network parts found: credentials in messages and reprs, control
characters in URLs, and CONNECT replies with bytes after their head or an interim 1xx head.

Real parts only: a hand-written CONNECT proxy and a TLS origin on 127.0.0.1; httpx, the
reference, runs in the same tests where it and Treadle agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import httpx
import pytest
import trustme

from connect_helpers import (
    NO_ENV,
    body,
    exchange,
    serve,
    server_context,
    tcp_server,
)
from treadle._http.connect import NetworkOptions, route_for
from treadle._http.errors import InvalidURL, ProxyError

# The test CA (`ca`, `ca_file`) and the clean environment come from conftest.py.
pytestmark = pytest.mark.usefixtures("clean_network")


# -- credentials never reach a message or a repr --------------------------------------------

LEAKY_PROXIES = [
    # (proxy URL, parts of its password that must not be shown)
    ("http://alice:S3cr\uff0fTpass@proxy.corp:3128", ["S3cr", "Tpass"]),  # urlsplit: NFKC '/'
    ("http://alice:p\u2100ss@proxy.corp:3128", ["p\u2100ss", "ss@"]),  # NFKC 'a/c'
    ("http://alice:hunter2/x@proxy.corp:3128", ["hunter2"]),  # unencoded '/'
    ("http://alice:9999/x@proxy.corp:3128", ["9999"]),  # would parse as host alice port 9999
    ("http://alice:se#cret@proxy.corp:3128", ["se#", "cret"]),
    ("http://alice:pa\nss@proxy.corp:3128", ["pa\n", "pa\\n", "ss@"]),
]


@pytest.mark.parametrize(("url", "secrets"), LEAKY_PROXIES)
def test_a_bad_proxy_url_is_refused_without_any_part_of_its_password(
    url: str, secrets: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(InvalidURL) as explicit:
        route_for("https://api.example.com/v1", NetworkOptions(proxy=url))
    monkeypatch.setenv("HTTPS_PROXY", url)
    with pytest.raises(InvalidURL) as from_env:
        route_for("https://api.example.com/v1", NetworkOptions())
    for message in (str(explicit.value), str(from_env.value)):
        assert "proxy.corp" in message  # still says which proxy URL is wrong
        for secret in secrets:
            assert secret not in message, message


def test_network_options_repr_hides_the_proxy_password() -> None:
    options = NetworkOptions(proxy="http://alice:topsecret@proxy:3128")
    assert "topsecret" not in repr(options) and "alice" not in repr(options)
    assert "proxy:3128" in repr(options)
    assert repr(NetworkOptions()).startswith("NetworkOptions(proxy=None, trust_env=True")


# -- control characters and whitespace: refused as httpx refuses them -----------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://api.openai.com\n.evil.example/v1",  # urlsplit drops the LF: another host
        "https://ex\tample.com/",
        "https://api.\r\nexample.com/",
        "http://127.0.0.\n1:8080/",
        "https://example.com\n",
        "https://example.com/v1\x00",
        "https://example.com/v1?q=\x7f",
    ],
)
def test_a_url_with_a_control_character_is_refused_as_httpx_refuses_it(url: str) -> None:
    with pytest.raises(httpx.InvalidURL):
        httpx.URL(url)
    with pytest.raises(InvalidURL, match="control character"):
        route_for(url, NO_ENV)
    with pytest.raises(InvalidURL, match="control character"):
        NetworkOptions(proxy=url.replace("https", "http", 1))


def test_a_space_is_refused_in_a_host_and_left_to_the_caller_in_a_path() -> None:
    with pytest.raises(InvalidURL, match="not a valid host"):
        route_for("https://exa mple.com/", NO_ENV)
    assert route_for("https://example.com/a b?q=c d", NO_ENV).host == "example.com"


# -- the proxy's reply to CONNECT ------------------------------------------------------------


def hand_proxy(reply: bytes, origin_port: int) -> object:
    """A CONNECT proxy that answers `reply`, then relays to 127.0.0.1:`origin_port`."""

    async def relay(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        origin_reader, origin_writer = await asyncio.open_connection("127.0.0.1", origin_port)
        try:
            await asyncio.gather(relay(reader, origin_writer), relay(origin_reader, writer))
        finally:
            origin_writer.close()

    return handle


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",  # a second head
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n\x16\x03\x01garbage",  # TLS-like bytes
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # an empty body
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n\r\n",  # a stray CRLF
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nX",
    ],
)
async def test_bytes_after_the_connect_reply_head_are_refused(
    reply: bytes, ca: trustme.CA, ca_file: str
) -> None:
    async with (
        serve(server_context(ca)) as origin,
        tcp_server(
            hand_proxy(reply, origin.port)  # type: ignore[arg-type]
        ) as port,
    ):
        options = NetworkOptions(proxy=f"http://127.0.0.1:{port}", verify=ca_file, trust_env=False)
        route = route_for(f"https://localhost:{origin.port}/v1", options)
        with pytest.raises(ProxyError, match="sent bytes after its 200 reply"):
            await exchange(route, options)


async def test_an_interim_100_before_the_200_is_skipped_as_httpx_skips_it(
    ca: trustme.CA, ca_file: str
) -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 Connection established\r\n\r\n"
    async with (
        serve(server_context(ca)) as origin,
        tcp_server(
            hand_proxy(reply, origin.port)  # type: ignore[arg-type]
        ) as port,
    ):
        proxy = f"http://127.0.0.1:{port}"
        options = NetworkOptions(proxy=proxy, verify=ca_file, trust_env=False)
        url = f"https://localhost:{origin.port}/v1"
        assert body(await exchange(route_for(url, options), options)) == b"hello from tls"
        verify = ssl.create_default_context(cafile=ca_file)
        async with httpx.AsyncClient(proxy=proxy, verify=verify, trust_env=False) as client:
            assert (await client.get(url)).content == b"hello from tls"


async def test_a_refusal_after_an_interim_head_names_its_own_status_and_reason() -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        await reader.read()  # until the client gives up

    async with tcp_server(proxy) as port:
        proxy_url = f"http://127.0.0.1:{port}"
        options = NetworkOptions(proxy=proxy_url, trust_env=False)
        with pytest.raises(ProxyError, match="with 403 Forbidden;") as caught:
            await exchange(route_for("https://localhost:1/", options), options)
        assert "Continue" not in str(caught.value)
        async with httpx.AsyncClient(proxy=proxy_url, trust_env=False) as client:
            with pytest.raises(httpx.ProxyError, match="403"):
                await client.get("https://localhost:1/")


async def test_a_proxy_echoing_the_credentials_in_its_reason_does_not_leak_them() -> None:
    # base64("u:p4ssw0rd"), then the password itself, in the 407's reason phrase.
    reply = b"HTTP/1.1 407 dTpwNHNzdzByZA== p4ssw0rd\r\nContent-Length: 0\r\n\r\n"

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        await reader.read()

    async with tcp_server(proxy) as port:
        options = NetworkOptions(proxy=f"http://u:p4ssw0rd@127.0.0.1:{port}", trust_env=False)
        with pytest.raises(ProxyError, match="407") as caught:
            await exchange(route_for("https://localhost:1/", options), options)
        message = str(caught.value)
        assert "p4ssw0rd" not in message and "dTpwNHNzdzByZA" not in message, message
