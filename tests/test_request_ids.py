"""Per-request usage entries carry the request id support asks for: the reply's `x-request-id`
header (the fake server sends `req_<n>`, one per reply), and the completion id when the reply had
no such header (a server without it, a custom executor). The id is decoded, capped and cleaned by
one rule (`treadle.errors.clean_id`) wherever it is shown: entries and error messages, through
Treadle's pool and through a user's `httpx.AsyncClient` alike."""

from __future__ import annotations

import httpx
import pytest

from test_http_parsing import raw_server
from treadle import ProviderError, Session
from treadle.errors import MAX_ID_CHARS, clean_id
from treadle.llm import Provider, aclose_clients, get_client
from treadle.loop import arun_session_loop
from treadle.testing import FakeOpenAIServer, Reply, ScriptedExecutor
from wire_helpers import completion, echo_wire

AGENT = Session.from_agent_prompt("sys")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_entry_carries_the_replys_x_request_id(stream: bool) -> None:
    with FakeOpenAIServer() as server:
        # The 503 reply is req_00000001; the retried request's reply (the one used) req_00000002.
        server.enqueue(Reply.server_error(503), Reply.text("hi"))
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=stream,
                            max_retries=1, retry_base_delay=0.0)  # fmt: skip
        out = await arun_session_loop(
            Session.from_user_message("hello"), AGENT, agent_provider=provider
        )
    [entry] = out.metadata["request_usage"]
    assert entry.request_id == "req_00000002"
    assert entry.response_id == "chatcmpl-00000002"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_without_the_header_the_entry_carries_the_completion_id(stream: bool) -> None:
    async with echo_wire() as wire:  # sends no x-request-id; its completion id is "c1"
        provider = Provider(model="m", base_url=wire.url, api_key="k", stream=stream)
        out = await arun_session_loop(
            Session.from_user_message("hello"), AGENT, agent_provider=provider
        )
    [entry] = out.metadata["request_usage"]
    assert (entry.request_id, entry.response_id) == ("c1", "c1")


async def test_a_custom_executors_entry_carries_the_completion_id() -> None:
    executor = ScriptedExecutor(["done"])
    out = await arun_session_loop(
        Session.from_user_message("hello"), AGENT, executor=executor, agent_provider=None
    )
    [entry] = out.metadata["request_usage"]
    assert entry.request_id == entry.response_id != ""


def _reply_with_id(raw_id: bytes, status: int = 200) -> bytes:
    """A whole reply (completion id "c1") whose `x-request-id` header is `raw_id`, as bytes."""
    body = completion("hi") if status == 200 else b'{"error": {"message": "bad request"}}'
    return b"HTTP/1.1 %d X\r\nx-request-id: %b\r\ncontent-length: %d\r\n\r\n%b" % (
        status, raw_id, len(body), body
    )  # fmt: skip


async def _entry_request_id(raw_id: bytes, users: httpx.AsyncClient | None) -> str:
    async with raw_server(_reply_with_id(raw_id)) as (url, _):
        provider = Provider(model="m", base_url=url.removesuffix("/chat/completions"),
                            api_key="k", http_client=users)  # fmt: skip
        out = await arun_session_loop(
            Session.from_user_message("hello"), AGENT, agent_provider=provider
        )
        await aclose_clients()
    [entry] = out.metadata["request_usage"]
    return str(entry.request_id)


@pytest.mark.parametrize(
    ("raw_id", "shown"),
    [
        ("réq-ü1".encode(), "réq-ü1"),  # UTF-8, not Latin-1 mojibake ("rÃ©q")
        (b"req\xe2\x80\xaeevil\tx", "reqevilx"),  # a bidi override and a tab dropped
        (b"a\x9b2Jb", "a\ufffd2Jb"),  # a stray byte (C1 CSI in Latin-1) is U+FFFD, shown inert
        (b"\x85\x9b\x9b", "c1"),  # nothing but bytes that are not UTF-8: the completion id
        ("\u202e\u202e".encode(), "c1"),  # nothing printable: the completion id
        (b"A" * 60_000, "A" * MAX_ID_CHARS),  # capped
    ],
    ids=["utf8", "bidi-tab", "stray-byte", "undecodable-only", "controls-only", "60k"],
)
async def test_the_request_id_is_decoded_capped_and_cleaned_through_both_transports(
    raw_id: bytes, shown: str
) -> None:
    async with httpx.AsyncClient() as users:
        assert await _entry_request_id(raw_id, None) == shown
        assert await _entry_request_id(raw_id, users) == shown


async def test_an_error_shows_the_request_id_capped_and_cleaned() -> None:
    # A 60,000-byte id used to make a 60,145-character message; a tab and a bidi override
    # reached the terminal as sent.
    for raw_id, shown in [(b"B" * 60_000, "B" * MAX_ID_CHARS), (b"x\t\xe2\x80\xaey", "xy")]:
        async with raw_server(_reply_with_id(raw_id, status=400)) as (url, _):
            provider = Provider(model="m", base_url=url.removesuffix("/chat/completions"),
                                api_key="k", max_retries=0)  # fmt: skip
            with pytest.raises(ProviderError) as caught:
                await get_client(provider).complete(provider, b'{"model":"m","messages":[]}')
            await aclose_clients()
        assert caught.value.request_id == shown
        assert str(caught.value).endswith(f"[request id {shown}]")
        assert len(str(caught.value)) < MAX_ID_CHARS + 300


def test_clean_id_is_the_one_rule() -> None:
    assert clean_id(None) == clean_id("") == clean_id(" \t ") == ""
    assert clean_id("  req_1 ") == "req_1"
    assert clean_id("\x1b[31mred\x1b[0m") == "[31mred[0m"  # ESC gone: no terminal escape
    assert clean_id("x" * 1000) == "x" * MAX_ID_CHARS
    assert ProviderError("m", request_id="\x85\x85").request_id is None
