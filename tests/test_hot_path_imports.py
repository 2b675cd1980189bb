"""A streamed pass runs no import statement once its modules are loaded.

An import statement inside a function runs at every call, and `from a.b import c` of a module
that is not a package costs about 2 µs (the import system asks `a.b` for `__path__`, and the
module formats an AttributeError message each time): the per-round and per-stream paths bind
their lazily loaded names once instead (docs/performance.md, issue 33's fifth round).
"""

from __future__ import annotations

import builtins
import sys
from typing import Any

import pytest

from treadle import (
    Provider,
    Session,
    arun_session_loop,
    stream_session_loop,
    tool,
)
from treadle.testing import FakeOpenAIServer


@tool
async def noop(round: int) -> dict[str, int]:
    """Do nothing and report the round."""
    return {"round": round}


async def test_streamed_rounds_and_streams_import_nothing_once_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    imported: list[str] = []
    real = builtins.__import__

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        # Only treadle's own statements: sniffio (under every anyio cancel scope, such as a tool
        # call's time limit) runs `from asyncio import current_task` at each call.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "treadle":
            imported.append(f"{caller}: {name}")
        return real(name, *args, **kwargs)

    agent = Session.from_agent_prompt("Use tools.")
    with FakeOpenAIServer(script="tool_loop") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=True)

        async def passes() -> None:
            user = Session.from_user_message("go")
            out = await arun_session_loop(user, agent, agent_provider=provider, tools=[noop])
            assert out.stop_reason == "final_answer"
            events = [e async for e in stream_session_loop(user, agent, agent_provider=provider)]
            assert type(events[-1]).__name__ == "PassStopped"

        await passes()  # loads what the first streamed pass loads
        monkeypatch.setattr(builtins, "__import__", counting)
        await passes()
        monkeypatch.undo()
    assert imported == []


async def test_a_patch_of_get_client_at_the_first_request_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # llm/turn.py binds `get_client` on its first call; a patch in place then (a test's
    # monkeypatch of treadle.llm.client) must not stay in use once it is undone.
    import treadle.llm.client as client
    import treadle.llm.turn as turn

    stand_in = vars(turn)["_on_first_call"]  # a fresh stand-in, as at import
    monkeypatch.setattr(
        turn, "get_client", stand_in("treadle.llm.client", "get_client", "treadle.llm.registry")
    )
    real = client.get_client
    calls: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    agent = Session.from_agent_prompt("x")
    with FakeOpenAIServer(script="echo") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=True)
        with monkeypatch.context() as patch:
            patch.setattr(client, "get_client", spy)
            await arun_session_loop(Session.from_user_message("a"), agent, agent_provider=provider)
        during = len(calls)
        await arun_session_loop(Session.from_user_message("b"), agent, agent_provider=provider)
    assert during >= 1  # the patch in place got the first request
    assert len(calls) == during  # and was not kept once undone
    assert vars(turn)["get_client"] is real  # the real function is bound from then on


async def test_a_tool_calls_time_limit_asks_sniffio_nothing_once_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The limit is anyio's own scope of the running backend (the class found once), not one
    found through sniffio twice a call (`move_on_after`: an import statement each time)."""
    import anyio
    import sniffio

    from treadle.tools import dispatch

    asked: list[str] = []
    real = sniffio.current_async_library

    def counting() -> str:
        frame = sys._getframe(1)
        while frame is not None:  # asked on behalf of a tool call's limit?
            if frame.f_code.co_filename == dispatch.__file__:
                asked.append(frame.f_code.co_name)
                break
            frame = frame.f_back  # type: ignore[assignment]
        return real()

    agent = Session.from_agent_prompt("Use tools.")
    with FakeOpenAIServer(script="tool_loop") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=True)
        user = Session.from_user_message("go")
        await arun_session_loop(user, agent, agent_provider=provider, tools=[noop])
        monkeypatch.setattr(sniffio, "current_async_library", counting)
        out = await arun_session_loop(user, agent, agent_provider=provider, tools=[noop])
        scope = dispatch._move_on_after(5.0)
        monkeypatch.undo()
    assert out.stop_reason == "final_answer" and any(r.calls for r in out.rows)
    assert asked == []
    assert type(scope) is type(anyio.move_on_after(5.0))
    assert 0 < scope.deadline - anyio.current_time() <= 5.0
