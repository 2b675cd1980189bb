"""A tool that raises `CancelledError` itself gets an error result; cancelling the pass cancels.

Re-expressed from the OpenAI Agents SDK's function-tool tests: before the fix, a tool raising
`asyncio.CancelledError` beside a sibling call crashed the round with `KeyError`, and alone it
ended the whole pass `cancelled`. Over loopback HTTP against the fake server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from treadle import Provider, Session, run_session_loop, tool
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply

AGENT = Session.from_agent_prompt("Use the tools.")


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test")


@tool
async def flaky() -> str:
    """A tool whose library cancels internally."""
    raise asyncio.CancelledError("the library gave up")


@tool
def sync_flaky() -> str:
    """A sync tool raising CancelledError (a timeout helper's internals)."""
    raise asyncio.CancelledError()


@tool
async def fine(x: int) -> int:
    """A well-behaved sibling."""
    await anyio.lowlevel.checkpoint()
    return x * 2


def _results(out: Session) -> list[dict[str, Any]]:
    return [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]


@pytest.mark.parametrize("name", ["flaky", "sync_flaky"])
def test_a_tool_raising_cancelled_alone_is_an_error_result(
    server: FakeOpenAIServer, name: str
) -> None:
    server.enqueue(Reply.tool_call(name, {}), Reply.text("recovered"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[flaky, sync_flaky],
    )  # fmt: skip
    assert out.stop_reason == "final_answer" and out.final_text == "recovered"
    [result] = _results(out)
    assert result["ok"] is False and result["error_kind"] == "tool_execution_exception"
    assert "CancelledError" in result["message"]


def test_a_tool_raising_cancelled_beside_a_sibling(server: FakeOpenAIServer) -> None:
    server.enqueue(
        Reply.tool_calls_of([("fine", {"x": 2}), ("flaky", {}), ("fine", {"x": 5})]),
        Reply.text("done"),
    )
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[flaky, fine],
    )  # fmt: skip
    assert out.stop_reason == "final_answer" and out.final_text == "done"
    first, middle, last = _results(out)
    assert first == {"ok": True, "result": 4} and last == {"ok": True, "result": 10}
    assert middle["error_kind"] == "tool_execution_exception"
    # the model saw all three results, in call order
    sent = [m for m in server.requests[-1].body["messages"] if m["role"] == "tool"]
    assert len(sent) == 3


def test_cancelling_the_pass_while_a_tool_runs_still_cancels(server: FakeOpenAIServer) -> None:
    started = threading.Event()
    finished = threading.Event()

    @tool
    async def slow() -> str:
        """Wait until cancelled."""
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            finished.set()
        return "never"

    server.enqueue(Reply.tool_calls_of([("slow", {}), ("fine", {"x": 1})]), Reply.text("late"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[slow, fine],
    )  # fmt: skip
    assert started.wait(60)
    out.cancel()
    assert out.stop_reason == "cancelled"
    assert finished.wait(60)  # the tool's task was cancelled, not abandoned
    assert "late" not in (out.final_text or "")


def _reraise_others(error: BaseException) -> str:
    """A policy handling its own error type and re-raising the rest (CancelledError too)."""
    if isinstance(error, KeyError):
        return "handled"
    raise error


def _interrupting(error: BaseException) -> str:
    raise KeyboardInterrupt("policy interrupted")


def _exiting(error: BaseException) -> str:
    raise SystemExit(3)


@pytest.mark.parametrize("policy", [_reraise_others, _interrupting, _exiting])
@pytest.mark.parametrize("raised", ["cancelled", "value"])
def test_any_exception_from_an_on_error_policy_falls_back_to_the_default_message(
    server: FakeOpenAIServer, policy: Any, raised: str
) -> None:
    @tool(on_error=policy)
    async def guarded() -> str:
        """A tool whose policy breaks."""
        if raised == "cancelled":
            raise asyncio.CancelledError("library-internal cancel")
        raise ValueError("original")

    rounds: list[list[tuple[str, dict[str, Any]]]] = [
        [("guarded", {})],
        [("guarded", {}), ("fine", {"x": 3})],
    ]
    for calls in rounds:
        server.enqueue(Reply.tool_calls_of(calls), Reply.text("answered"))
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
            tools=[guarded, fine],
        )  # fmt: skip
        assert out.stop_reason == "final_answer" and out.final_text == "answered"
        results = _results(out)
        assert len(results) == len(calls)
        assert results[0]["error_kind"] == "tool_execution_exception"
        assert "on_error function raised" in results[0]["message"]
        if len(calls) == 2:
            assert results[1] == {"ok": True, "result": 6}


@pytest.mark.parametrize("behaviour", ["convert", "swallow"])
@pytest.mark.parametrize("with_sibling", [False, True])
def test_cancelling_the_pass_cancels_whatever_the_tool_makes_of_it(
    server: FakeOpenAIServer, behaviour: str, with_sibling: bool
) -> None:
    started = threading.Event()
    caught = threading.Event()

    @tool
    async def stubborn() -> str:
        """Turns the pass's cancellation into its own error, or swallows it."""
        started.set()
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            caught.set()
            if behaviour == "convert":
                raise RuntimeError("request aborted") from None
        return "swallowed"

    calls: list[tuple[str, dict[str, Any]]] = [("stubborn", {})]
    if with_sibling:
        calls.append(("fine", {"x": 1}))
    server.enqueue(Reply.tool_calls_of(calls), Reply.text("answered anyway"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[stubborn, fine],
    )  # fmt: skip
    assert started.wait(60)
    out.cancel()
    assert out.stop_reason == "cancelled"
    assert caught.is_set()
    assert "answered anyway" not in (out.final_text or "")
    assert len(server.requests) == 1  # the model was not asked again


def test_cancelling_an_awaiting_task_cancels_a_converting_tool(server: FakeOpenAIServer) -> None:
    from treadle import arun_session_loop

    async def main() -> str:
        started = threading.Event()  # the pass may run on the runtime's own loop thread

        @tool
        async def converting() -> str:
            """Turns cancellation into RuntimeError."""
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                raise RuntimeError("request aborted") from None
            return "never"

        server.enqueue(Reply.tool_call("converting", {}), Reply.text("answered anyway"))
        running = arun_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
            tools=[converting],
        )  # fmt: skip
        task = asyncio.create_task(running)
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "not cancelled"

    assert asyncio.run(main()) == "cancelled"
