"""A streamed pass runs no import statement once its modules are loaded.

An import statement inside a function runs at every call, and `from a.b import c` of a module
that is not a package costs about 2 µs (the import system asks `a.b` for `__path__`, and the
module formats an AttributeError message each time): the per-round and per-stream paths bind
their lazily loaded names once instead (docs/performance.md, issue 33's fifth round).
"""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from treadle import Provider, Session, arun_session_loop, stream_session_loop, tool
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
        imported.append(name)
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
