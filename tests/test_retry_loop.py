"""One retry loop: how many requests each failure costs, and how the turn ends.

Every retry of a request happens in `ModelClient`'s one loop (a status, a lost connection, an
in-band error among the first events: nothing was handed on yet). The one restart outside it is a
stream that fails after its first events went out (a lost connection, an in-band 429/5xx
mid-stream, as OpenRouter sends it): the turn asks again with the same budget, so a turn sends at
most `max_retries + 1` requests. A custom executor is called once: it owns its transport.

The server below sends a stream's first event, then holds the rest until the turn has handed that
event on (the delta sink opens a gate), so "after the first event" is the order of events on the
wire, never a race between reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from treadle import ProviderError, RateLimitError, Session
from treadle.errors import ConfigurationError, MalformedResponse
from treadle.llm import Provider, aclose_clients
from treadle.llm.attempt import TornStream
from treadle.llm.request import CompletionRequest
from treadle.llm.turn import HttpExecutor, TurnDelta, request_turn
from treadle.loop import arun_session_loop
from treadle.tools import ToolSet
from wire_helpers import chunk, event

AGENT = Session.from_agent_prompt("sys")
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
DONE = b"data: [DONE]\n\n"
GATE = b"<gate>"  # in a script: wait until the turn handed the events before it on
TEAR = b"<tear>"  # in a script: drop the connection here


def error_event(code: int, message: str) -> bytes:
    """OpenRouter's in-band failure: a chunk carrying `error` (recorded shape)."""
    choice = {"index": 0, "delta": {"content": ""}, "finish_reason": None}
    payload = {"id": "gen-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
               "error": {"code": code, "message": message}, "choices": [choice]}  # fmt: skip
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


GOOD = [event("Paris", "stop"), DONE]


class Wire:
    """A raw HTTP/1.1 server answering the n-th request with the n-th script (then GOOD)."""

    def __init__(self, scripts: list[list[bytes]]) -> None:
        self.scripts = scripts
        self.requests = 0
        self.gate = asyncio.Event()
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))  # fmt: skip
                await reader.readexactly(length)
                script = self.scripts[self.requests] if self.requests < len(self.scripts) else GOOD
                self.requests += 1
                self.gate.clear()
                writer.write(HEAD)
                for piece in script:
                    if piece == GATE:
                        await writer.drain()
                        await self.gate.wait()
                    elif piece == TEAR:
                        writer.transport.abort()
                        return
                    else:
                        writer.write(chunk(piece))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def wire(*scripts: list[bytes]) -> AsyncIterator[Wire]:
    served = Wire(list(scripts))
    server = await asyncio.start_server(served.handle, "127.0.0.1", 0)
    served.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        yield served
    finally:
        server.close()


async def turn_on(served: Wire, retries: int) -> tuple[str | None, list[str]]:
    """One streamed turn through the pooled client: its text and every delta handed on."""
    provider = Provider(model="m", base_url=served.url, api_key="k", max_retries=retries,
                        retry_base_delay=0.0, stream=True)  # fmt: skip
    user = Session.from_user_message("hello")
    request = CompletionRequest("s", provider, AGENT.rows, user.rows, ToolSet.build([]),
                                stream=True)  # fmt: skip
    seen: list[str] = []

    def sink(delta: TurnDelta) -> None:
        seen.append(delta.text or "")
        served.gate.set()

    turn = await request_turn(HttpExecutor(), request, sink)
    return turn.payload["content"], seen


async def test_an_inband_error_before_the_first_event_is_retried_as_a_request() -> None:
    async with wire([error_event(503, "overloaded"), DONE]) as served:
        text, seen = await turn_on(served, retries=1)
    assert (text, seen, served.requests) == ("Paris", ["Paris"], 2)  # nothing handed on twice


async def test_an_inband_429_before_the_first_event_spends_the_request_budget() -> None:
    async with wire([error_event(429, "slow down")], [error_event(429, "slow down")]) as served:
        with pytest.raises(RateLimitError, match="slow down") as caught:
            await turn_on(served, retries=1)
    assert served.requests == 2
    assert "after 1 retry" in caught.value.message


async def test_an_inband_error_after_events_restarts_the_turn() -> None:
    async with wire([event("Par"), GATE, error_event(503, "overloaded"), DONE]) as served:
        text, seen = await turn_on(served, retries=1)
    # The first attempt's event went out before the error: the turn starts over once.
    assert (text, seen, served.requests) == ("Paris", ["Par", "Paris"], 2)


async def test_an_inband_error_after_events_with_no_budget_is_final() -> None:
    async with wire([event("Par"), GATE, error_event(503, "overloaded"), DONE]) as served:
        with pytest.raises(ProviderError, match="overloaded") as caught:
            await turn_on(served, retries=0)
    assert (caught.value.status_code, served.requests) == (503, 1)


async def test_a_non_retryable_inband_error_after_events_is_not_restarted() -> None:
    # OpenRouter's recorded "Token limit reached" (code 400): the same request fails the same way.
    async with wire([event("Par"), GATE, error_event(400, "Token limit reached"), DONE]) as served:
        with pytest.raises(ProviderError, match="Token limit reached") as caught:
            await turn_on(served, retries=3)
    assert (caught.value.status_code, served.requests) == (400, 1)


async def test_a_stream_torn_after_its_first_event_restarts_the_turn() -> None:
    async with wire([event("Par"), GATE, TEAR]) as served:
        text, seen = await turn_on(served, retries=1)
    assert (text, seen, served.requests) == ("Paris", ["Par", "Paris"], 2)


async def test_a_stream_torn_after_its_first_event_with_no_budget_is_final() -> None:
    async with wire([event("Par"), GATE, TEAR]) as served:
        with pytest.raises(MalformedResponse, match="torn"):
            await turn_on(served, retries=0)
    assert served.requests == 1


async def test_the_request_loop_and_the_turn_restart_share_one_budget() -> None:
    # The first request fails before any event (retried by the request loop: 1 of 1 retry); the
    # second is torn after its first event: the budget is spent, so no third request.
    async with wire([error_event(503, "overloaded")], [event("Par"), GATE, TEAR]) as served:
        with pytest.raises(MalformedResponse, match="torn"):
            await turn_on(served, retries=1)
    assert served.requests == 2


class Failing:
    """A custom executor whose reply is a provider error: counted, never retried by Treadle."""

    def __init__(self, outcome: dict[str, Any] | ProviderError) -> None:
        self.outcome = outcome
        self.calls = 0

    async def acomplete(self, request: CompletionRequest) -> dict[str, Any]:
        self.calls += 1
        if isinstance(self.outcome, ProviderError):
            raise self.outcome
        return self.outcome


def _request(retries: int) -> CompletionRequest:
    provider = Provider(model="m", base_url="http://127.0.0.1:9/v1", api_key="k",
                        max_retries=retries, retry_base_delay=0.0)  # fmt: skip
    user = Session.from_user_message("hello")
    return CompletionRequest("s", provider, AGENT.rows, user.rows, ToolSet.build([]))


async def test_a_custom_executor_error_naming_a_status_is_typed_and_not_retried() -> None:
    body = json.dumps({"error": {"code": 429, "message": "busy upstream"}})
    executor = Failing(ProviderError("the upstream failed", body=body))
    with pytest.raises(RateLimitError, match="busy upstream"):
        await request_turn(executor, _request(retries=3))
    assert executor.calls == 1


async def test_a_custom_executor_inband_error_is_typed_and_not_retried() -> None:
    reply = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
             "error": {"code": 503, "message": "overloaded"},
             "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                          "finish_reason": "stop"}]}  # fmt: skip
    executor = Failing(reply)
    with pytest.raises(ProviderError, match="overloaded") as caught:
        await request_turn(executor, _request(retries=3))
    assert (caught.value.status_code, executor.calls) == (503, 1)


async def test_a_stream_being_read_when_aclose_clients_runs_ends_client_closed() -> None:
    # The server holds the rest of the stream; the first delta closes the loop's clients.
    async with wire([event("Par"), GATE, event("is", "stop"), DONE]) as served:
        provider = Provider(model="m", base_url=served.url, api_key="k", max_retries=3,
                            retry_base_delay=0.0, stream=True)  # fmt: skip
        closing: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()

        def start_closing() -> None:
            if not closing:
                closing.append(loop.create_task(aclose_clients()))

        def close_clients(_: object) -> None:  # on_event may run off the loop: hand it over
            loop.call_soon_threadsafe(start_closing)

        with pytest.raises(ConfigurationError, match=r"closed \(aclose_clients\(\)\)") as caught:
            await arun_session_loop(Session.from_user_message("hello"), AGENT,
                                    agent_provider=provider, on_event=close_clients)  # fmt: skip
        await closing[0]
    assert "torn" not in str(caught.value)
    assert served.requests == 1  # a closed client is not restarted


class _CloseOnRestart(logging.Handler):
    """Starts `aclose_clients()` when the turn logs that it will restart a torn stream: the close
    runs at the loop's next step, inside the turn's backoff sleep (whatever its length)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.closing: list[asyncio.Task[None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("restarting the turn") and not self.closing:
            self.closing.append(asyncio.get_running_loop().create_task(aclose_clients()))


async def test_aclose_clients_while_a_turn_waits_to_restart_ends_client_closed() -> None:
    # The first stream is torn after its first event (an in-band 503, budget left): the turn
    # sleeps before restarting, and the clients are closed meanwhile. The restart must go through
    # the closed client, as a retry of the request loop does (the client-closed error), not take
    # a fresh client and open new connections.
    handler = _CloseOnRestart()
    logger = logging.getLogger("treadle.llm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        async with wire([event("Par"), GATE, error_event(503, "overloaded"), DONE]) as served:
            with pytest.raises(ConfigurationError, match=r"closed \(aclose_clients\(\)\)"):
                await turn_on(served, retries=3)
            await handler.closing[0]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert served.requests == 1  # no request after the close


async def test_a_turn_that_spent_its_restarts_says_how_many_retries() -> None:
    # As the request loop's final errors say "after N retries", so does a turn's: torn twice
    # and an in-band 503 twice, each with one restart allowed.
    torn = [event("Par"), GATE, TEAR]
    async with wire(torn, torn) as served:
        with pytest.raises(MalformedResponse, match="torn after 1 retry"):
            await turn_on(served, retries=1)
    assert served.requests == 2
    inband = [event("Par"), GATE, error_event(503, "overloaded"), DONE]
    async with wire(inband, inband) as served:
        with pytest.raises(ProviderError, match="server error after 1 retry: overloaded") as caught:
            await turn_on(served, retries=1)
    assert (caught.value.status_code, served.requests) == (503, 2)
    async with wire(inband) as served:  # no retry spent: nothing to say
        with pytest.raises(ProviderError) as caught:
            await turn_on(served, retries=0)
    assert "after" not in str(caught.value)


class _TornExecutor:
    """A custom executor raising Treadle's internal TornStream (retryable): still called once."""

    def __init__(self) -> None:
        self.calls = 0

    async def acomplete(self, request: CompletionRequest) -> dict[str, Any]:
        self.calls += 1
        raise TornStream(MalformedResponse("torn upstream"), retryable=True)


class _TornSubclass(HttpExecutor):
    """An HttpExecutor subclass whose own astream raises TornStream: its stream, called once."""

    calls = 0

    async def astream(self, request: CompletionRequest) -> AsyncIterator[Any]:
        type(self).calls += 1
        raise TornStream(MalformedResponse("torn upstream"), retryable=True)
        yield  # an async generator, as astream is


async def test_a_custom_executor_raising_torn_stream_is_called_once() -> None:
    executor = _TornExecutor()
    with pytest.raises(MalformedResponse, match="torn upstream"):
        await request_turn(executor, _request(retries=3))
    assert executor.calls == 1
    provider = Provider(model="m", base_url="http://127.0.0.1:9/v1", api_key="k",
                        max_retries=3, retry_base_delay=0.0, stream=True)  # fmt: skip
    user = Session.from_user_message("hello")
    request = CompletionRequest("s", provider, AGENT.rows, user.rows, ToolSet.build([]),
                                stream=True)  # fmt: skip
    with pytest.raises(MalformedResponse, match="torn upstream"):
        await request_turn(_TornSubclass(), request, lambda _: None)
    assert _TornSubclass.calls == 1
