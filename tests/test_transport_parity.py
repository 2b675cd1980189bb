"""The same malformed reply through Treadle's pool and through a user's `httpx.AsyncClient`
(`HttpxTransport`) gets the same typed error after the same number of requests: httpx's own
protocol errors are mapped to what the pool raises for that reply, so a reply the pool refuses at
once (a 101 upgrade, a status outside 100-599, a transfer coding other than `chunked`) is not
retried as a lost connection through httpx either. Every malformed reply costs one request through
either client: a reply llhttp or h11 refuses to parse is never retried as a lost connection. Where
httpx reads a reply the pool refuses (Content-Length beside chunked, a run of 1xx heads, unbounded
heads and trailers, a folded header line, `Content-Length: 2, 2`) the two differ; those cases are
in `test_http_parsing.py`, against httpx, and the last two below."""

from __future__ import annotations

import zlib

import httpx
import pytest

from test_http_parsing import MALFORMED, raw_server
from treadle._http import protocol
from treadle._http.protocol import MAX_BODY_BYTES
from treadle.errors import ConfigurationError, MalformedResponse
from treadle.llm import Provider, aclose_clients, get_client
from treadle.llm import transport as transport_module
from treadle.testing import FakeOpenAIServer

# httpx reads these (or, for a head past the pool's cap, waits for its end: a read timeout).
ACCEPTED_BY_HTTPX = {
    "length-with-chunked",
    "1xx-run",
    "trailer-flood",
    "endless-head",
    "obs-fold",
    "same-lengths-listed",
}
WIRES = {name: wire for name, (wire, _) in MALFORMED.items() if name not in ACCEPTED_BY_HTTPX}
WIRES.update({
    "gzip-corrupt": b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 5\r\n\r\nabcde",
    "status-600": b"HTTP/1.1 600 Odd\r\ncontent-length: 2\r\n\r\n{}",
})  # fmt: skip


async def _outcome(provider: Provider, stream: bool) -> type[BaseException]:
    body = b'{"model":"m","messages":[],"stream":%s}' % (b"true" if stream else b"false")
    client = get_client(provider)
    try:
        if stream:
            async for _ in client.stream(provider, body):
                pass
        else:
            await client.complete(provider, body)
    except Exception as exc:  # the typed error is the outcome compared
        return type(exc)
    finally:
        await aclose_clients()
    raise AssertionError("the malformed reply was accepted")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(WIRES))
async def test_a_malformed_reply_gets_the_same_error_and_retries_through_both(
    case: str, stream: bool
) -> None:
    outcomes = []
    async with raw_server(WIRES[case]) as (url, seen):
        base = url.removesuffix("/chat/completions")
        async with httpx.AsyncClient() as users:
            for client in (None, users):
                seen.clear()
                provider = Provider(model="m", base_url=base, api_key="k", max_retries=2,
                                    retry_base_delay=0.001, timeout=(5.0, 5.0),
                                    http_client=client)  # fmt: skip
                outcomes.append((await _outcome(provider, stream), len(seen)))
    assert outcomes[0] == outcomes[1], outcomes
    # The server would send the same bytes again: one request, never retried as a lost
    # connection (max_retries=2 would make it 3).
    assert outcomes[0] == (MalformedResponse, 1), outcomes


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", ["obs-fold", "same-lengths-listed"])
async def test_a_reply_httpx_reads_and_llhttp_refuses_is_refused_once(
    case: str, stream: bool
) -> None:
    # A folded header line (RFC 9112 5.2 asks a user agent to unfold it) and `Content-Length:
    # N, N` (RFC 9110 8.6 allows reading it as N): httpx reads both; the pool refuses them as
    # llhttp does, with a MalformedResponse after one request, never a retried lost connection.
    # The decision is documented in docs/providers.md (HTTP transport).
    wire = MALFORMED[case][0]
    async with raw_server(wire) as (url, seen):
        base = url.removesuffix("/chat/completions")
        provider = Provider(model="m", base_url=base, api_key="k", max_retries=2,
                            retry_base_delay=0.001, timeout=(5.0, 5.0))  # fmt: skip
        assert await _outcome(provider, stream) is MalformedResponse
        assert len(seen) == 1
        async with httpx.AsyncClient() as users:
            response = await users.post(url, content=b"{}")
            assert (response.status_code, response.content) == (200, b"{}")


async def test_a_header_httpx_refuses_to_send_is_the_pools_configuration_error() -> None:
    with FakeOpenAIServer() as server:
        async with httpx.AsyncClient() as users:
            for client in (None, users):
                provider = Provider(model="m", base_url=server.base_url, max_retries=2,
                                    api_key="sk-secret-key\nx", http_client=client)  # fmt: skip
                with pytest.raises(ConfigurationError) as caught:
                    await get_client(provider).complete(provider, b'{"model":"m"}')
                assert "sk-secret-key" not in str(caught.value)
        assert server.request_count == 0


def _gzip_bomb(mib: int) -> bytes:
    """A 200 reply whose small gzip body decompresses to `mib` MiB of zeros."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    body = b"".join([packer.compress(zeros) for _ in range(mib)]) + packer.flush()
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body)
    return head + body


async def _refused_over(cap: int, transport: str, stream: bool) -> int:
    """Requests sent for a bomb decompressing past `cap`, refused as over the cap."""
    users = httpx.AsyncClient()
    try:
        async with raw_server(_gzip_bomb(cap // (1 << 20) + 4)) as (url, seen):
            provider = Provider(model="m", base_url=url.removesuffix("/chat/completions"),
                                api_key="k", max_retries=2, retry_base_delay=0.001,
                                http_client=users if transport == "httpx" else None)  # fmt: skip
            body = b'{"model":"m","messages":[],"stream":%s}' % (b"true" if stream else b"false")
            client = get_client(provider)
            with pytest.raises(MalformedResponse, match=f"over {cap} bytes"):
                if stream:
                    async for _ in client.stream(provider, body):
                        pass
                else:
                    await client.complete(provider, body)
            await aclose_clients()
    finally:
        await users.aclose()
    return len(seen)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("transport", ["pool", "httpx"])
async def test_the_decompressed_size_cap_holds_through_both(
    transport: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # httpx used to read the whole reply (`response.content`: gigabytes for a small bomb) and
    # fail on its JSON; both transports now stop at the cap with the same error, sent once. The
    # cap is lowered to 4 MiB here (both modules read it when a body arrives) to keep this fast;
    # the real one is in the slow test below.
    cap = 4 << 20
    monkeypatch.setattr(protocol, "MAX_BODY_BYTES", cap)
    monkeypatch.setattr(transport_module, "MAX_BODY_BYTES", cap)
    assert await _refused_over(cap, transport, stream) == 1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["pool", "httpx"])
async def test_the_real_decompressed_size_cap_holds_through_both(transport: str) -> None:
    assert await _refused_over(MAX_BODY_BYTES, transport, stream=False) == 1
