"""The HTTP/1.1 pool (`treadle._http.pool`): every reply shape HTTP/1.1 allows, every way a server
can break one, the pool's limits, timeouts and cancellation. Real sockets on loopback throughout:
the project's fake server for replies it can script, a raw asyncio server for byte-level abuse.
(Ported from the tests of the lane it replaced; the parsing matrix is in test_http_parsing.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from net_helpers import cancel_held_requests, read_request, unanswered_port
from treadle import ConfigurationError, Provider, Session, run_session_loop
from treadle._http import protocol
from treadle._http.errors import (
    BodyClosed,
    ConnectError,
    ConnectTimeout,
    DecodeError,
    InvalidHeader,
    InvalidURL,
    ReadTimeout,
    RemoteProtocolError,
    StaleConnection,
    TLSError,
)
from treadle._http.pool import NetworkOptions, Pool
from treadle._http.protocol import MAX_HEAD_BYTES, Connection
from treadle._http.reply import Headers, Timeouts
from treadle.testing import FakeOpenAIServer, Reply

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
STREAM_BODY = BODY[:-1] + b',"stream":true}'
HEADERS = {"content-type": "application/json", "authorization": "Bearer k"}
T = Timeouts(5.0, 5.0, 5.0)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer("echo") as srv:
        yield srv


@pytest.fixture
async def lane() -> AsyncIterator[Pool]:
    pool = Pool()
    yield pool
    await pool.aclose()


async def post(
    pool: Pool, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
) -> tuple[int, Headers, bytes]:
    reply = await pool.post(url, body, headers, timeouts)
    return reply.status, reply.headers, reply.content


async def post_stream(
    pool: Pool, url: str, body: bytes, headers: dict[str, str], timeouts: Timeouts
) -> tuple[int, Headers, AsyncIterator[bytes]]:
    reply = await pool.post_stream(url, body, headers, timeouts)
    return reply.status, reply.headers, reply.body  # type: ignore[return-value]


def chat(server: FakeOpenAIServer) -> str:
    return f"{server.base_url}/chat/completions"


@contextlib.asynccontextmanager
async def raw_server(replies: list[bytes], *, close_after: bool = False) -> AsyncIterator[str]:
    """A server answering each request with the next of `replies`, byte for byte."""
    queue = list(replies)
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(1)
        try:
            while queue:
                await read_request(reader)
                writer.write(queue.pop(0))
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        srv.close()


def reply(body: bytes, *extra: str, status: str = "200 OK") -> bytes:
    head = "".join(f"{line}\r\n" for line in extra)
    return f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body


def chunked(*pieces: bytes, trailer: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    for piece in pieces:
        out += b"%x;ext=1\r\n%b\r\n" % (len(piece), piece)
    return out + b"0\r\n" + trailer + b"\r\n"


# -- replies HTTP/1.1 allows -------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    for _ in range(5):
        status, headers, content = await post(lane, chat(server), BODY, HEADERS, T)
        assert status == 200 and b"choices" in content
        assert headers["Content-Type"].startswith("application/json")  # case-insensitive
    assert len(server._connections) == 1


@pytest.mark.parametrize(
    "wire",
    [
        reply(b'{"ok":1}'),
        chunked(b'{"ok"', b":1}", trailer=b"x-trailer: yes\r\n"),
        reply(gzip.compress(b'{"ok":1}'), "content-encoding: gzip"),
        reply(zlib.compress(b'{"ok":1}'), "content-encoding: deflate"),
        b"HTTP/1.1 100 Continue\r\n\r\n" + reply(b'{"ok":1}'),
        b'HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{"ok":1}',
    ],
    ids=["length", "chunked+trailer", "gzip", "deflate", "100-continue", "until-close"],
)
async def test_reply_framings(lane: Pool, wire: bytes) -> None:
    async with raw_server([wire], close_after=True) as url:
        status, _, content = await post(lane, url, BODY, HEADERS, T)
    assert (status, content) == (200, b'{"ok":1}')


async def test_gzip_chunked_stream_arrives_decoded(lane: Pool) -> None:
    packed = gzip.compress(b"data: 1\n\ndata: [DONE]\n\n")
    wire = chunked(packed[:10], packed[10:]).replace(
        b"transfer-encoding", b"content-encoding: gzip\r\ntransfer-encoding"
    )
    async with raw_server([wire]) as url:
        status, _, body = await post_stream(lane, url, STREAM_BODY, HEADERS, T)
        data = b"".join([piece async for piece in body])
        await body.aclose()
    assert status == 200 and data == b"data: 1\n\ndata: [DONE]\n\n"


async def test_connection_close_is_honoured(lane: Pool) -> None:
    async with raw_server([reply(b"{}", "connection: close"), reply(b"{}")]) as url:
        await post(lane, url, BODY, HEADERS, T)
        assert lane.idle_connections == 0  # not pooled
    assert lane.open_connections == 0 or all(p.closed for p in lane._all)


async def test_error_statuses_are_returned_with_their_body(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    server.enqueue(Reply.error(429, "slow down", headers={"retry-after": "1"}))
    status, headers, content = await post(lane, chat(server), BODY, HEADERS, T)
    assert status == 429 and headers["retry-after"] == "1" and b"slow down" in content


# -- replies that break HTTP/1.1 ---------------------------------------------------------------


@pytest.mark.parametrize(
    "wire",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbroken header line\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * (MAX_HEAD_BYTES + 10),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        reply(b"not gzip", "content-encoding: gzip"),
        reply(b"{}", "content-encoding: br"),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",
    ],
    ids=[
        "not-http",
        "bad-header",
        "endless-head",
        "bad-chunk-size",
        "two-lengths",
        "corrupt-gzip",
        "unoffered-encoding",
        "unknown-transfer-coding",
        "short-body",
    ],
)
async def test_broken_replies_are_typed_errors(lane: Pool, wire: bytes) -> None:
    # (Bytes past a complete reply are not here: that reply is returned, see test_http_parsing.)
    async with raw_server([wire], close_after=True) as url:
        with pytest.raises((RemoteProtocolError, DecodeError)):
            await post(lane, url, BODY, HEADERS, T)
    assert lane.idle_connections == 0  # nothing broken pooled


@pytest.mark.parametrize("fault", [Reply.dropped_connection(), Reply.text("a" * 200).torn(1)])
async def test_fresh_drop_and_truncation_are_remote_protocol_errors(
    server: FakeOpenAIServer, lane: Pool, fault: Reply
) -> None:
    server.enqueue(fault)
    with pytest.raises(RemoteProtocolError) as info:
        await post(lane, chat(server), BODY, HEADERS, T)
    assert not isinstance(info.value, StaleConnection)  # a fresh connection is not stale


async def test_a_reused_connection_dropped_unanswered_is_stale(
    server: FakeOpenAIServer, lane: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stale means "closed within STALE_WINDOW_SECONDS of the write": 5 ms of wall clock, which
    # the fake server's thread overruns on a loaded machine (the same drop is then a plain
    # RemoteProtocolError, as it should be). Widen the window: this test is about which
    # connection is stale; the window's edges are test_llm_stale_connection's.
    monkeypatch.setattr(protocol, "STALE_WINDOW_SECONDS", 3600.0)
    await post(lane, chat(server), BODY, HEADERS, T)
    server.enqueue(Reply.dropped_connection())
    with pytest.raises(StaleConnection):
        await post(lane, chat(server), BODY, HEADERS, T)
    assert server.request_count == 2  # the drop answered this request, not another
    status, _, _ = await post(lane, chat(server), BODY, HEADERS, T)
    assert status == 200


async def test_torn_stream_is_remote_protocol_error(server: FakeOpenAIServer, lane: Pool) -> None:
    server.enqueue(Reply.text("y" * 80, chunk_chars=4).torn(3))
    status, _, body = await post_stream(lane, chat(server), STREAM_BODY, HEADERS, T)
    assert status == 200
    with pytest.raises(RemoteProtocolError):
        async for _ in body:
            pass
    await body.aclose()


async def test_refused_and_unresolvable_are_connect_errors(lane: Pool) -> None:
    with pytest.raises(ConnectError):
        await post(lane, "http://127.0.0.1:9/v1/chat/completions", BODY, HEADERS, T)
    with pytest.raises(ConnectError):
        await post(lane, "http://no-such-host.invalid/v1", BODY, HEADERS, T)
    assert lane.open_connections == 0


async def test_https_to_a_silent_plain_http_port_is_a_connect_timeout(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    # Silence after the ClientHello: the whole connect budget, then a timeout (never "use http").
    url = chat(server).replace("http://", "https://")
    with pytest.raises(ConnectTimeout):
        await post(lane, url, BODY, HEADERS, Timeouts(0.3, 5, 5))


async def test_connect_timeout(lane: Pool) -> None:
    with unanswered_port() as port, pytest.raises(ConnectTimeout):
        await post(lane, f"http://127.0.0.1:{port}/", BODY, HEADERS, Timeouts(0.2, 5, 5))
    assert lane.open_connections == 0


@pytest.mark.parametrize(
    "fault",
    [Reply.text("late").with_latency(3000), Reply.text("b" * 300).stalled(3000)],
    ids=["before-head", "mid-body"],
)
async def test_read_timeouts(server: FakeOpenAIServer, lane: Pool, fault: Reply) -> None:
    server.enqueue(fault)
    with pytest.raises(ReadTimeout):
        await post(lane, chat(server), BODY, HEADERS, Timeouts(5, 0.1, 5))
    # the connection of the timed-out reply is dropped; the next request gets a fresh one
    status, _, _ = await post(lane, chat(server), BODY, HEADERS, T)
    assert status == 200


async def test_read_timeout_mid_stream(server: FakeOpenAIServer, lane: Pool) -> None:
    server.enqueue(Reply.text("z" * 50, chunk_chars=5).stalled(3000))
    _, _, body = await post_stream(lane, chat(server), STREAM_BODY, HEADERS, Timeouts(5, 0.1, 5))
    with pytest.raises(ReadTimeout):
        async for _ in body:
            pass
    await body.aclose()


async def test_a_slow_reader_is_not_a_read_timeout(lane: Pool) -> None:
    big = b"x" * (3 * 1024 * 1024)  # past the pause mark: reading pauses for the reader
    async with raw_server([reply(big)]) as url:
        _, _, body = await post_stream(lane, url, STREAM_BODY, HEADERS, Timeouts(5, 0.1, 5))
        await asyncio.sleep(0.4)  # the reader dawdles for four read timeouts
        got = b"".join([piece async for piece in body])
        await body.aclose()
    assert got == big


async def test_header_injection_is_refused_before_sending(lane: Pool) -> None:
    async with raw_server([reply(b"{}")]) as url:
        for bad in ({"x-key": "k\r\nx-evil: 1"}, {"x-key": "k\n"}, {"bad:name": "v"}, {"": "v"}):
            with pytest.raises(InvalidHeader):  # a mistake to fix, not a failure to retry
                await post(lane, url, BODY, bad, T)
    assert lane.open_connections == 0


async def test_non_ascii_header_values_go_as_utf8_and_paths_are_percent_encoded(
    lane: Pool,
) -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(reply(b"{}"))
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        url = f"http://127.0.0.1:{port}/v1/café/chat?q=a b"
        status, _, _ = await post(lane, url, BODY, {"x-title": "Café ✓"}, T)
    finally:
        srv.close()
    assert status == 200
    assert seen[0].startswith(b"POST /v1/caf%C3%A9/chat?q=a%20b HTTP/1.1\r\n")
    assert "x-title: Café ✓\r\n".encode() in seen[0]  # as aiohttp sent it before


def test_a_key_with_a_newline_fails_the_pass_at_once_without_retries() -> None:
    # `api_key=open("key.txt").read()` keeps the file's last newline.
    with FakeOpenAIServer("echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="sk-abc\n", max_retries=3)
        out = run_session_loop(
            Session.from_user_message("hi"), Session.from_agent_prompt("s"), agent_provider=provider
        )
        with pytest.raises(ConfigurationError, match="line break"):
            out.synchronize(timeout=30)
        assert server.request_count == 0


async def test_not_http_urls_are_refused(lane: Pool) -> None:
    with pytest.raises(InvalidURL):
        await post(lane, "ftp://example.com/v1", BODY, HEADERS, T)


# -- the pool ----------------------------------------------------------------------------------


async def test_the_limit_caps_open_connections(server: FakeOpenAIServer) -> None:
    pool = Pool(max_connections=3)
    server.latency_ms = 20
    try:
        results = await asyncio.gather(
            *(post(pool, chat(server), BODY, HEADERS, T) for _ in range(30))
        )
        assert all(status == 200 for status, _, _ in results)
        assert len(server._connections) <= 3 and pool.open_connections <= 3
    finally:
        await pool.aclose()


async def test_cancellation_closes_connections_and_the_pool_stays_usable(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    async def send() -> int:
        status, _, _ = await post(lane, chat(server), BODY, HEADERS, T)
        return status

    await cancel_held_requests(server, send)
    assert lane.open_connections == 1


async def test_an_abandoned_stream_closes_its_connection(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    server.enqueue(Reply.text("q" * 64, chunk_chars=8).stalled(5000))
    _, _, body = await post_stream(lane, chat(server), STREAM_BODY, HEADERS, T)
    assert (await anext(body)).startswith(b"data: ")
    await body.aclose()  # stopped early: the connection cannot carry another request
    assert lane.idle_connections == 0


async def test_a_closed_pool_refuses_requests(server: FakeOpenAIServer) -> None:
    pool = Pool(max_connections=10)
    await post(pool, chat(server), BODY, HEADERS, T)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        await post(pool, chat(server), BODY, HEADERS, T)


async def test_closing_a_stream_twice_pools_its_connection_once(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    # Found by the streamed fan-out benchmark: a second `aclose` pooled the connection again, two
    # requests then shared it and both hung.
    _, _, body = await post_stream(lane, chat(server), STREAM_BODY, HEADERS, T)
    _ = [piece async for piece in body]
    await body.aclose()
    await body.aclose()
    lane.release(body._conn, body._ex)  # type: ignore[attr-defined]  # a stray release: ignored
    assert lane.idle_connections == 1
    server.latency_ms = 30
    results = await asyncio.wait_for(
        asyncio.gather(*(post(lane, chat(server), BODY, HEADERS, T) for _ in range(2))),
        10,
    )
    assert [status for status, _, _ in results] == [200, 200]


# -- HTTPS -------------------------------------------------------------------------------------


async def test_https_round_trip_and_an_untrusted_certificate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ssl

    import trustme

    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                writer.write(reply(b'{"tls":true}'))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context)
    url = f"https://localhost:{srv.sockets[0].getsockname()[1]}/v1/chat/completions"
    try:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        untrusting = Pool(max_connections=10)  # the default CAs only
        with pytest.raises(TLSError, match=r"(?i)certificate"):
            await post(untrusting, url, BODY, HEADERS, T)
        untrusting.close()
        with ca.cert_pem.tempfile() as bundle:
            pool = Pool(max_connections=10, options=NetworkOptions(verify=bundle))
            for _ in range(3):
                status, _, content = await post(pool, url, BODY, HEADERS, T)
                assert (status, content) == (200, b'{"tls":true}')
            assert pool.open_connections == 1  # kept alive over TLS
            await pool.aclose()
    finally:
        srv.close()
        await asyncio.sleep(0)


# -- any split of the bytes ------------------------------------------------------------------

WIRES = [
    (reply(b'{"a":"' + b"x" * 300 + b'"}'), b'{"a":"' + b"x" * 300 + b'"}'),
    (chunked(b"ab", b"c" * 40, b"d", trailer=b"x-t: 1\r\n"), b"ab" + b"c" * 40 + b"d"),
    (
        reply(gzip.compress(b"z" * 500), "content-encoding: gzip"),
        b"z" * 500,
    ),
    (b"HTTP/1.1 100 Continue\r\n\r\n" + chunked(b"hello"), b"hello"),
]


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, len(WIRES) - 1),
    cuts=st.lists(st.integers(1, 700), max_size=12),
    stream=st.booleans(),
)
def test_any_split_of_the_bytes_reads_the_same(which: int, cuts: list[int], stream: bool) -> None:
    wire, expected = WIRES[which]
    pieces, start = [], 0
    for cut in sorted(set(cuts)):
        if start < cut < len(wire):
            pieces.append(wire[start:cut])
            start = cut
    pieces.append(wire[start:])

    async def read() -> bytes:
        left, right = socket.socketpair()
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: Connection(lambda _: None, None, []), sock=left
        )  # type: ignore[arg-type]
        try:
            ex = conn.begin("http://x/", stream=stream, read=None)
            for piece in pieces:  # as the kernel might have cut them
                conn.data_received(piece)
            assert ex.complete and ex.error is None
            if not stream:
                await ex.head
                return ex.content()
            return b"".join(ex.queue)
        finally:
            conn.close()
            right.close()
            await asyncio.sleep(0)

    assert asyncio.run(read()) == expected


async def test_the_servers_keep_alive_timeout_is_respected(lane: Pool) -> None:
    # Node's servers close idle connections after 5 s and say so in `Keep-Alive: timeout=5`;
    # reusing one as it closes loses the request. The lane stops reusing at 80% of the hint.
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                await read_request(reader)
                writer.write(reply(b"{}", "keep-alive: timeout=0.5, max=100"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1/chat/completions"
    try:
        await post(lane, url, BODY, HEADERS, T)
        await post(lane, url, BODY, HEADERS, T)
        assert len(connections) == 1  # reused while fresh
        await asyncio.sleep(0.45)  # past 80% of the server's 0.5 s
        await post(lane, url, BODY, HEADERS, T)
        assert len(connections) == 2  # a new connection, not one the server is closing
    finally:
        srv.close()


async def test_a_body_read_after_aclose_never_reads_the_next_reply(
    server: FakeOpenAIServer, lane: Pool
) -> None:
    _, _, body = await post_stream(lane, chat(server), STREAM_BODY, HEADERS, T)
    _ = [piece async for piece in body]
    await body.aclose()  # read to its end: the connection goes back to the pool
    _, _, second = await post_stream(lane, chat(server), STREAM_BODY, HEADERS, T)
    assert len(server._connections) == 1  # the same connection carries the second reply
    with pytest.raises(BodyClosed):
        await anext(body)
    assert b"[DONE]" in b"".join([piece async for piece in second])  # all of it, for its reader
    await second.aclose()


async def test_the_decompressed_size_is_capped(lane: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("treadle._http.protocol.MAX_BODY_BYTES", 10_000)
    bomb = gzip.compress(b"0" * 50_000)  # 50 KB from a few dozen bytes
    async with raw_server([reply(bomb, "content-encoding: gzip")], close_after=True) as url:
        with pytest.raises(DecodeError, match="over 10000 bytes"):
            await post(lane, url, BODY, HEADERS, T)
    assert lane.idle_connections == 0
