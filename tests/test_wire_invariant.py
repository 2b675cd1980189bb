"""The wire's invariant: a connection goes back to the pool only after its reply was read to its
end. Every early exit (an in-band error mid-stream, a cancelled pass, a callback that raises, a
chunk that fails validation, a read timeout, an abandoned stream) must close the connection, or the
next request on it reads the old reply's tail as its own answer: one user gets another's reply.

The server (`wire_helpers.echo_wire`) answers each request with its own user message and, for the
early exits, holds the rest of the reply until the client speaks again on that connection; after
the exits, several passes on the same Provider must each get their own echo, on one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from treadle import ProviderError, Session
from treadle.errors import MalformedResponse, ProviderTimeout
from treadle.llm import Provider, build_request_body, get_client
from treadle.llm.request import CompletionRequest
from treadle.llm.turn import HttpExecutor, request_turn
from treadle.loop import arun_session_loop
from treadle.tools import ToolSet
from wire_helpers import echo_wire

AGENT = Session.from_agent_prompt("sys")


class Boom(Exception):
    """A user callback's failure."""


async def _pass(provider: Provider, message: str, **options: object) -> str:
    out = await arun_session_loop(
        Session.from_user_message(message),
        AGENT,
        agent_provider=provider,
        **options,  # type: ignore[arg-type]
    )
    return out.final_text or ""


def _early_exits(provider: Provider) -> list[Callable[[], Awaitable[None]]]:
    """Each early exit, once, on `provider` (a streamed pass unless it says otherwise)."""

    async def inband_error() -> None:  # an {"error": ...} chunk mid-stream, the tail held back
        with pytest.raises(ProviderError, match="Token limit reached"):
            await _pass(provider, "inband-error")

    async def inband_error_all_sent() -> None:  # the same reply, all of it parsed but unread
        with pytest.raises(ProviderError, match="Token limit reached"):
            await _pass(provider, "inband-sent")

    async def invalid_chunk() -> None:  # a chunk that fails validation mid-stream
        with pytest.raises(MalformedResponse):
            await _pass(provider, "bad-chunk")

    async def raising_callback() -> None:
        # The turn's own delta sink raises on the first delta (`on_event` runs apart from the
        # stream and reports its error when the turn ends, so this is where a consumer stops).
        def explode(_: object) -> None:
            raise Boom

        user = Session.from_user_message("hold-callback")
        request = CompletionRequest(
            "s", provider, AGENT.rows, user.rows, ToolSet.build([]), stream=True
        )
        with pytest.raises(Boom):
            await request_turn(HttpExecutor(), request, explode)

    async def cancelled() -> None:  # a pass cancelled after its first delta arrived
        first = asyncio.Event()
        task = asyncio.create_task(_pass(provider, "hold-cancel", on_event=lambda _: first.set()))
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def read_timeout() -> None:  # the rest never comes: torn after its first event
        slow = provider.replace(timeout=(5.0, 0.3), max_retries=0)
        with pytest.raises(MalformedResponse, match="Timed out"):
            await _pass(slow, "hold-timeout")

    async def abandoned() -> None:  # a reader that stops after one chunk
        client = get_client(provider)
        body = build_request_body(
            provider, [b'{"role":"user","content":"hold-abandoned"}'], stream=True
        )
        chunks = client.stream(provider, body)
        async with contextlib.aclosing(chunks):
            await anext(chunks)

    return [
        inband_error,
        inband_error_all_sent,
        invalid_chunk,
        raising_callback,
        cancelled,
        read_timeout,
        abandoned,
    ]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_every_early_exit_closes_and_every_pass_gets_its_own_reply(stream: bool) -> None:
    async with echo_wire() as wire:
        provider = Provider(model="m", base_url=wire.url, api_key="k", max_retries=0, stream=True)
        after = provider.replace(stream=stream)
        for n, exit_early in enumerate(_early_exits(provider)):
            assert await _pass(after, f"warm-{n}") == f"echo:warm-{n}"  # a kept-alive connection
            await exit_early()
            assert await _pass(after, f"check-{n}") == f"echo:check-{n}"
        assert wire.held >= 6
        for i in range(5):
            assert await _pass(after, f"next-{i}") == f"echo:next-{i}"
        passes = [conn for conn, message in wire.seen if message.startswith("next-")]
        assert len(set(passes)) == 1  # all on one kept-alive connection
        # No connection carried a request after an early exit on it (the reply read whole, then
        # the error found, is the one exit that may keep its connection: nothing is left unread).
        for conn, message in wire.seen:
            if message.startswith(("hold", "inband-error", "bad-chunk")):
                later = [
                    m for c, m in wire.seen[wire.seen.index((conn, message)) + 1 :] if c == conn
                ]
                assert later == [], (message, later)


async def test_a_whole_reply_cut_by_a_read_timeout_is_not_reused() -> None:
    async with echo_wire() as wire:
        provider = Provider(model="m", base_url=wire.url, api_key="k", max_retries=0)
        with pytest.raises(ProviderTimeout):
            await _pass(provider.replace(timeout=(5.0, 0.3)), "hold-whole")
        for i in range(3):
            assert await _pass(provider, f"next-{i}") == f"echo:next-{i}"
