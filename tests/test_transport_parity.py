"""The same malformed reply through Treadle's pool and through a user's `httpx.AsyncClient`
(`HttpxTransport`) gets the same typed error after the same number of requests: httpx's own
protocol errors are mapped to what the pool raises for that reply, so a reply the pool refuses at
once (a 101 upgrade, a status outside 100-599, a transfer coding other than `chunked`) is not
retried as a lost connection through httpx either. Where httpx reads a reply the pool refuses
(Content-Length beside chunked, a run of 1xx heads, unbounded heads and trailers) the two differ;
those cases are in `test_http_parsing.py`, against httpx, and left out here."""

from __future__ import annotations

import httpx
import pytest

from test_http_parsing import MALFORMED, raw_server
from treadle.errors import ConfigurationError
from treadle.llm import Provider, aclose_clients, get_client
from treadle.testing import FakeOpenAIServer

# httpx reads these (or, for a head past the pool's cap, waits for its end: a read timeout).
ACCEPTED_BY_HTTPX = {"length-with-chunked", "1xx-run", "trailer-flood", "endless-head"}
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
