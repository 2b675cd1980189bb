"""The reply-parsing matrix: every malformed head, length and chunk framing, and the request
smuggling classics, refused by the pool as a typed `MalformedReply` (not retried) with the
connection never pooled (a status outside 100-599, a 101 upgrade or a transfer coding other than
`chunked` at once, as `UnsupportedReply`); bounded heads (across reads), 1xx runs and trailers;
bare-LF replies read at once; a stray CRLF, or junk, after a complete reply: the reply is
returned, not re-sent. Each wire is also sent to httpx in the same test, and where httpx agrees
the test says so (it is the reference for what a trusted client does)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from net_helpers import read_request
from treadle._http.errors import HTTPError, MalformedReply, RemoteProtocolError, UnsupportedReply
from treadle._http.pool import Pool
from treadle._http.protocol import (
    MAX_HEAD_BYTES,
    MAX_INTERIM_REPLIES,
    MAX_TRAILER_BYTES,
    Connection,
)
from treadle._http.reply import Timeouts
from treadle.errors import MalformedResponse
from treadle.llm import Provider, get_client

BODY = b'{"model":"m","messages":[]}'
HEADERS = {"content-type": "application/json"}
T = Timeouts(5.0, 5.0, 5.0)

CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@contextlib.asynccontextmanager
async def raw_server(wire: bytes) -> AsyncIterator[tuple[str, list[int]]]:
    """A server answering every request with `wire`, byte for byte; yields (url, requests seen)."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                seen.append(1)
                writer.write(wire)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/chat/completions", seen
    finally:
        srv.close()


async def httpx_refuses(url: str) -> bool:
    """Whether httpx (its defaults) refuses the reply at `url`."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        try:
            response = await client.post(url, content=BODY, headers=HEADERS)
        except httpx.HTTPError:
            return True
        return response.status_code != 200


MALFORMED = {
    "chunk-size-0x": (CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n", True),
    "chunk-size-plus": (CHUNKED + b"+5\r\nhello\r\n0\r\n\r\n", True),
    "chunk-size-underscore": (CHUNKED + b"0_5\r\nhello\r\n0\r\n\r\n", True),
    "chunk-size-negative": (CHUNKED + b"-3\r\nhello\r\n0\r\n\r\n", True),
    "chunk-extension-bare-lf": (CHUNKED + b"5;a\nb\r\nhello\r\n0\r\n\r\n", True),
    "status-2000": (b"HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\n{}", True),
    "status-superscript": ("HTTP/1.1 ²00 OK\r\ncontent-length: 2\r\n\r\n{}".encode(), True),
    "length-superscript": ("HTTP/1.1 200 OK\r\ncontent-length: ²\r\n\r\n{}".encode(), True),
    "length-with-chunked": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        False,  # httpx (h11) lets chunked win, as RFC 9112 allows a client to
    ),
    "two-differing-lengths": (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}x",
        True,
    ),
    "not-http": (b"SMTP ready\r\n\r\n", True),
    "header-without-colon": (b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n", True),
    "status-099": (b"HTTP/1.1 099 Odd\r\ncontent-length: 2\r\n\r\n{}", True),
    "101-upgrade": (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n{}", True),
    "te-chunked-gzip": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n", True
    ),
    "te-gzip-chunked": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", True
    ),
    "endless-head": (b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * (MAX_HEAD_BYTES + 10), True),
    "1xx-run": (
        b"HTTP/1.1 100 Continue\r\n\r\n" * 1000 + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        False,  # httpx reads every interim head
    ),
    "te-identity-with-length": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\ncontent-length: 2\r\n\r\n{}", True
    ),
    "space-before-colon": (b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\n{}", True),
    "nul-in-header": (b"HTTP/1.1 200 OK\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\n{}", True),
    "status-http2": (b"HTTP/2 200 OK\r\ncontent-length: 2\r\n\r\n{}", True),
    "lower-case-version": (b"http/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", True),
    # RFC 9112 5.2 asks a user agent to unfold an obs-fold, and RFC 9110 8.6 lets a recipient
    # read `N, N` as N; llhttp (Node's parser, uvicorn's) refuses both, and so does the pool,
    # once, never retried (unfolding would need llhttp's lenient_headers, which also lets
    # control characters into values). httpx reads them (`test_transport_parity.py`).
    "obs-fold": (b"HTTP/1.1 200 OK\r\nx-a: b\r\n c\r\ncontent-length: 2\r\n\r\n{}", False),
    "same-lengths-listed": (b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n{}", False),
    "trailer-flood": (
        CHUNKED + b"2\r\n{}\r\n0\r\n" + b"x-t: " + b"a" * 1000 + b"\r\n" * 1
        + (b"x-t: " + b"a" * 1000 + b"\r\n") * (MAX_TRAILER_BYTES // 1000 + 2) + b"\r\n",
        False,  # httpx reads trailers without a bound
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_replies_are_malformed_reply_errors_never_pooled(case: str) -> None:
    wire, httpx_agrees = MALFORMED[case]
    pool = Pool()
    try:
        async with raw_server(wire) as (url, seen):
            # A MalformedReply (a RemoteProtocolError), never the plain "connection lost" one
            # that the client retries: the server would send the same bytes again.
            with pytest.raises(MalformedReply):
                await pool.post(url, BODY, HEADERS, T)
            assert pool.idle_connections == 0  # the connection was never pooled
            assert await httpx_refuses(url) is httpx_agrees
    finally:
        await pool.aclose()
    assert len(seen) >= 1


@pytest.mark.parametrize(
    "case", ["status-099", "101-upgrade", "te-chunked-gzip", "te-gzip-chunked"]
)
async def test_unsupported_replies_are_refused_at_once_as_unsupported(case: str) -> None:
    # Refused when the head ends (T's 5 s read timeout would make a wait a ReadTimeout), as a
    # typed UnsupportedReply the client does not retry: the server answers the same every time.
    pool = Pool()
    try:
        async with raw_server(MALFORMED[case][0]) as (url, _):
            with pytest.raises(UnsupportedReply):
                await pool.post(url, BODY, HEADERS, T)
    finally:
        await pool.aclose()


async def test_a_101_upgrade_reaches_the_user_once_and_is_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # httptools raises HttpParserUpgrade (not an HttpParserError): it used to escape
    # data_received (asyncio's "Fatal error" log) and be retried as a dropped connection.
    async with raw_server(MALFORMED["101-upgrade"][0]) as (url, seen):
        base = url.removesuffix("/chat/completions")
        provider = Provider(model="m", base_url=base, api_key="k", max_retries=2,
                            retry_base_delay=0.001)  # fmt: skip
        with pytest.raises(MalformedResponse, match="101 Switching Protocols"):
            await get_client(provider).complete(provider, BODY)
        assert len(seen) == 1
    assert not [r for r in caplog.records if r.name == "asyncio" and "Fatal" in r.getMessage()]


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}extra",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}x",
        b"HTTP/1.1 204 No Content\r\n\r\n{}",
    ],
    ids=["body-past-length", "one-stray-byte", "204-with-body"],
)
async def test_a_complete_reply_followed_by_junk_is_returned_once_and_not_pooled(
    wire: bytes,
) -> None:
    # The server finished the reply (and billed it): it is returned, never re-sent; the junk
    # after it puts the connection out of step, so the connection is closed, not pooled.
    pool = Pool()
    try:
        async with raw_server(wire) as (url, seen):
            reply = await pool.post(url, BODY, HEADERS, T)
            assert reply.status in (200, 204)
            assert reply.content == (b"{}" if reply.status == 200 else b"")
            assert pool.idle_connections == 0
            assert len(seen) == 1
    finally:
        await pool.aclose()


async def test_a_head_split_over_reads_is_bounded_by_its_whole_size() -> None:
    # Each read under the bound, the head over it: the bound counts the head across reads.
    left, right = socket.socketpair()
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: Connection(lambda _: None, None, []), sock=left)  # type: ignore[arg-type]
    try:
        ex = conn.begin("http://x/", stream=False, read=None)
        half = b"a" * (MAX_HEAD_BYTES * 3 // 4)
        conn.data_received(b"HTTP/1.1 200 OK\r\nx-a: " + half + b"\r\n")
        assert ex.error is None
        conn.data_received(b"x-b: " + half + b"\r\ncontent-length: 2\r\n\r\n{}")
        assert isinstance(ex.error, RemoteProtocolError)
        assert f"head is over {MAX_HEAD_BYTES}" in str(ex.error)
        assert conn.closed
    finally:
        conn.close()
        right.close()
        await asyncio.sleep(0)


async def test_a_thousand_interim_heads_in_one_read_are_refused_without_recursion() -> None:
    wire = (
        b"HTTP/1.1 100 Continue\r\n\r\n" * 1000 + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    )
    pool = Pool()
    try:
        async with raw_server(wire) as (url, _):
            with pytest.raises(RemoteProtocolError, match=f"over {MAX_INTERIM_REPLIES} 1xx"):
                await pool.post(url, BODY, HEADERS, T)
    finally:
        await pool.aclose()


async def test_a_few_interim_heads_are_skipped() -> None:
    wire = b"HTTP/1.1 100 Continue\r\n\r\n" * 3 + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    pool = Pool()
    try:
        async with raw_server(wire) as (url, _):
            reply = await pool.post(url, BODY, HEADERS, T)
            assert (reply.status, reply.content) == (200, b"{}")
            assert not await httpx_refuses(url)
    finally:
        await pool.aclose()


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: 2\n\n{}",
        b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\n\n2\r\n{}\r\n0\r\n\r\n",
    ],
    ids=["length", "chunked"],
)
async def test_bare_lf_heads_are_read_at_once_as_httpx_reads_them(wire: bytes) -> None:
    pool = Pool()
    try:
        async with raw_server(wire) as (url, seen):
            reply = await pool.post(url, BODY, HEADERS, T)
            assert (reply.status, reply.content) == (200, b"{}")
            assert not await httpx_refuses(url)
    finally:
        await pool.aclose()
    assert seen


async def test_a_stray_crlf_after_a_complete_reply_is_accepted_and_not_resent() -> None:
    wire = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}\r\n"
    pool = Pool()
    try:
        async with raw_server(wire) as (url, seen):
            for _ in range(3):
                reply = await pool.post(url, BODY, HEADERS, T)
                assert reply.content == b"{}"
            assert len(seen) == 3  # each request sent once
            assert not await httpx_refuses(url)
    finally:
        await pool.aclose()


async def test_bytes_on_an_idle_connection_close_it() -> None:
    # A reply followed, in a later read, by bytes nobody asked for: the connection is out of
    # step with its server and is never reused (httpx would serve them as the next reply).
    left, right = socket.socketpair()
    loop = asyncio.get_running_loop()
    lost: list[Connection] = []
    _, conn = await loop.create_connection(lambda: Connection(lost.append, None, []), sock=left)  # type: ignore[arg-type]
    try:
        ex = conn.begin("http://x/", stream=False, read=None)
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        assert ex.complete and conn.exchange is None and not conn.closed
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")
        assert conn.closed
    finally:
        conn.close()
        right.close()
        await asyncio.sleep(0)


def test_errors_are_typed_not_bare_value_errors() -> None:
    # A bad Content-Length or status used to raise a bare ValueError inside data_received.
    assert issubclass(RemoteProtocolError, HTTPError)
