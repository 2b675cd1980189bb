"""TLS as httpx does it: certifi, the system store, SSL_CERT_*, verify=, client certificates,
ALPN, and the connect budget covering the handshake (a slow one is a timeout, never "plain HTTP").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from connect_helpers import (
    NO_ENV,
    Collect,
    Origin,
    answer,
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
    TLSError,
)
from treadle.testing.fake_proxy import TLSFront

# The test CA (`ca`, `ca_file`) and the clean environment come from conftest.py.
pytestmark = pytest.mark.usefixtures("clean_network")


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


async def test_reading_the_ca_file_is_not_charged_to_the_connect_budget(
    ca: trustme.CA, tmp_path: Path
) -> None:
    # Loading the trusted CAs is local work, once per process and settings; certifi's bundle
    # took over a second of wall clock on a loaded machine, so a 0.5 s budget ran out before a
    # byte was sent, and the retry, waiting on the same load, never reached the server either.
    # Here the CA file is a FIFO filled only after twice the budget: the connection must still
    # reach the (silent) server, and time out in its handshake.
    accepted = 0

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await reader.read()

    fifo = tmp_path / "ca.pem"
    os.mkfifo(fifo)
    options = NetworkOptions(verify=str(fifo), trust_env=False)
    async with tcp_server(silent) as port:
        route = route_for(f"https://127.0.0.1:{port}/", options)
        connecting = asyncio.create_task(exchange(route, options, budget=0.5))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(fifo.write_bytes, ca.cert_pem.bytes())  # the build reads it
        with pytest.raises(ConnectTimeout, match="connect timeout"):
            await connecting
        # The client's connect() ran before its first await under the budget, so the server
        # has the connection; its loop may take a while to accept it on a loaded machine.
        for _ in range(600):
            if accepted:
                break
            await asyncio.sleep(0.05)
        assert accepted == 1


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
        await answer(reader, writer, seen)

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
