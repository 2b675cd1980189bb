"""ModelClient over real loopback HTTP to the fake server: replies, usage, faults, retries."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic_core import to_json

from treadle.errors import (
    AuthenticationError,
    ContextLengthError,
    MalformedResponse,
    ProviderConnectionError,
    ProviderError,
    ProviderTimeout,
    RateLimitError,
)
from treadle.llm import (
    ChatCompletion,
    Provider,
    StreamAccumulator,
    aclose_clients,
    build_request_body,
    get_client,
)
from treadle.testing import FakeOpenAIServer, Reply

KEY = "sk-live-NEVER-SHOW-THIS-KEY-0123456789"
USER = [to_json({"role": "user", "content": "hello there"})]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer("echo") as srv:
        yield srv


def provider_for(server: FakeOpenAIServer, **kw: object) -> Provider:
    options: dict[str, object] = {"retry_base_delay": 0.001, "api_key": KEY}
    options.update(kw)
    return Provider(model="fake-model", base_url=server.base_url, **options)  # type: ignore[arg-type]


async def complete(provider: Provider) -> ChatCompletion:
    return await get_client(provider).complete(
        provider, build_request_body(provider, USER, stream=False)
    )


async def stream(provider: Provider) -> ChatCompletion:
    acc = StreamAccumulator()
    body = build_request_body(provider, USER, stream=True)
    async for chunk in get_client(provider).stream(provider, body):
        acc.add(chunk)
    return acc.result()


async def test_non_streaming_text_and_usage(server: FakeOpenAIServer) -> None:
    provider = provider_for(server)
    result = await complete(provider)
    assert result.message.content == "hello there" and result.finish_reason == "stop"
    assert result.usage is not None and result.usage.total_tokens > 0
    sent = server.requests[-1]
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.body["model"] == "fake-model" and sent.body["stream"] is False
    server.enqueue(Reply.text("counted").with_usage(11, 7))
    usage = (await complete(provider)).usage
    assert usage is not None and (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.total_tokens,
    ) == (11, 7, 18)


async def test_streaming_text_with_usage_chunk(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.text("a streamed answer that spans several chunks").with_usage(3, 4))
    result = await stream(provider_for(server))
    assert result.message.content == "a streamed answer that spans several chunks"
    assert result.usage is not None and result.usage.total_tokens == 7
    assert server.requests[-1].body["stream_options"] == {"include_usage": True}


async def test_streaming_parallel_tool_calls(server: FakeOpenAIServer) -> None:
    calls = [("read_file", {"path": "a.txt"}), ("run_shell_command", {"cmd": "ls -la /tmp"})]
    server.enqueue(Reply.tool_calls_of(calls, chunk_chars=3))
    result = await stream(provider_for(server))
    got = [(c.function.name, c.function.arguments) for c in result.message.tool_calls or []]
    assert got == [(n, to_json(a).decode()) for n, a in calls]
    assert result.finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") for c in result.message.tool_calls or [])


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(
    "fault",
    [
        Reply.rate_limited(0),
        Reply.server_error(500),
        Reply.server_error(502),
        Reply.server_error(503),
        Reply.dropped_connection(),
        Reply.error(408, "timeout"),
    ],
    ids=["429", "500", "502", "503", "dropped", "408"],
)
async def test_retryable_faults_are_retried(
    server: FakeOpenAIServer, fault: Reply, streamed: bool
) -> None:
    server.add_fault(fault, times=2)
    provider = provider_for(server)
    result = await (stream(provider) if streamed else complete(provider))
    assert result.message.content == "hello there"
    assert server.request_count == 3  # two faults seen by the server, then success


@pytest.mark.slow  # waits out real retries, 23 s: `make test-slow`
async def test_retries_exhausted_raise_typed_errors(server: FakeOpenAIServer) -> None:
    server.add_fault(Reply.rate_limited(0))
    with pytest.raises(RateLimitError) as info:
        await complete(provider_for(server, max_retries=2))
    assert server.request_count == 3 and info.value.status_code == 429
    assert info.value.request_id and info.value.request_id.startswith("req_")
    server.clear_faults()
    server.add_fault(Reply.server_error(503))
    with pytest.raises(ProviderError) as err:
        await complete(provider_for(server, max_retries=0))
    assert err.value.status_code == 503
    server.clear_faults()
    server.add_fault(Reply.dropped_connection())
    with pytest.raises(ProviderConnectionError):
        await complete(provider_for(server, max_retries=1))


@pytest.mark.parametrize("call", [complete, stream])
async def test_retry_after_header_is_honoured(server: FakeOpenAIServer, call: Any) -> None:
    server.add_fault(Reply.rate_limited(0.3), times=1)
    provider = provider_for(server, retry_base_delay=0.0)  # no backoff of our own: only the header
    started = time.monotonic()
    await call(provider)
    waited = time.monotonic() - started
    assert server.request_count == 2
    assert waited >= 0.3  # a lower bound only: the client waited at least what the server asked


@pytest.mark.parametrize("flavor", ["openai", "llamacpp", "vllm"])
async def test_context_length_errors_are_typed_and_not_retried(
    server: FakeOpenAIServer, flavor: str
) -> None:
    server.add_fault(Reply.context_length_exceeded(flavor))  # type: ignore[arg-type]
    with pytest.raises(ContextLengthError) as info:
        await complete(provider_for(server))
    assert info.value.status_code == 400 and server.request_count == 1


async def test_other_4xx_are_not_retried(server: FakeOpenAIServer) -> None:
    server.add_fault(Reply.bad_request("messages must not be empty"))
    with pytest.raises(ProviderError, match="messages must not be empty") as info:
        await stream(provider_for(server))
    assert type(info.value) is ProviderError and server.request_count == 1


async def test_key_never_appears_in_errors_or_logs(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server.add_fault(Reply.rate_limited(0), times=1)
    server.add_fault(Reply.error(401, f"Incorrect API key provided: {KEY}."))
    provider = provider_for(server)
    with pytest.raises(AuthenticationError) as info:
        await complete(provider)
    exc = info.value
    for text in (str(exc), repr(exc), exc.body or "", exc.message, caplog.text, repr(provider)):
        assert KEY not in text
    assert "***" in (exc.body or "")
    assert "retrying" in caplog.text


@pytest.mark.parametrize("streamed", [False, True])
async def test_malformed_replies(server: FakeOpenAIServer, streamed: bool) -> None:
    provider = provider_for(server)
    for fault in (Reply.invalid_json(), Reply.no_choices()):
        server.enqueue(fault)
        with pytest.raises(MalformedResponse):
            await (stream(provider) if streamed else complete(provider))


async def test_stream_torn_after_chunks_is_malformed_and_not_retried(
    server: FakeOpenAIServer,
) -> None:
    server.enqueue(Reply.tool_calls_of([("f", {"a": "x" * 50})], chunk_chars=5).torn(4))
    with pytest.raises(MalformedResponse, match="torn"):
        await stream(provider_for(server))
    assert server.request_count == 1


async def test_stream_torn_before_any_chunk_is_retried(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.text("partial").torn(0))
    result = await stream(provider_for(server))
    assert result.message.content == "hello there" and server.request_count == 2


async def test_slow_first_byte_times_out(server: FakeOpenAIServer) -> None:
    server.add_fault(Reply.text("late").with_latency(2000))
    with pytest.raises(ProviderTimeout):
        await complete(provider_for(server, timeout=(1.0, 0.1), max_retries=1))
    assert server.request_count == 2


async def test_refused_connection_is_a_connection_error() -> None:
    provider = Provider(model="m", base_url="http://127.0.0.1:9/v1", max_retries=1,
                        retry_base_delay=0.001)  # fmt: skip
    with pytest.raises(ProviderConnectionError, match="connect"):
        await complete(provider)


async def test_clients_are_pooled_per_endpoint_and_closable(server: FakeOpenAIServer) -> None:
    a, b = provider_for(server), provider_for(server, temperature=0.1)
    assert get_client(a) is get_client(b)
    assert get_client(provider_for(server, api_key="sk-other-key-000000000")) is not get_client(a)
    client = get_client(a)
    await aclose_clients()
    assert client.closed and get_client(a) is not client
    assert (await complete(a)).message.content == "hello there"


async def test_user_supplied_http_client_is_used_and_left_open(server: FakeOpenAIServer) -> None:
    import httpx

    async with httpx.AsyncClient() as http:
        provider = provider_for(server, http_client=http)
        assert get_client(provider).http is http
        assert (await complete(provider)).message.content == "hello there"
        await aclose_clients()
        assert not http.is_closed


async def test_official_openai_client_parses_the_fake_server(server: FakeOpenAIServer) -> None:
    import openai

    server.enqueue(
        Reply.text("plain answer"),
        Reply.tool_calls_of([("f", {"x": 1}), ("g", {"y": 2})]),
    )
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x") as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "plain answer"
        assert reply.usage is not None and reply.usage.total_tokens > 0
        chunks = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        names, usage = [], None
        async for chunk in chunks:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    if call.function and call.function.name:
                        names.append(call.function.name)
            usage = chunk.usage or usage
        assert names == ["f", "g"] and usage is not None
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]


async def test_stream_yields_the_chunks_before_a_malformed_one(server: FakeOpenAIServer) -> None:
    good = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    bad = {"id": "c1", "choices": [{"index": "first", "delta": {}}]}
    body = f"data: {to_json(good).decode()}\n\ndata: {to_json(bad).decode()}\n\n".encode()
    server.enqueue(Reply.raw(body, content_type="text/event-stream"))
    provider = provider_for(server)
    seen: list[str | None] = []
    with pytest.raises(MalformedResponse, match="does not match the schema"):
        async for chunk in get_client(provider).stream(
            provider, build_request_body(provider, USER, stream=True)
        ):
            seen.append(chunk.choices[0].delta.content if chunk.choices else None)
    assert seen == ["Hi"]
    await aclose_clients()
