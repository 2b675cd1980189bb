"""`tools.tool.bounded`: a tool call's time limit, with the timer armed at the call's first wait."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from treadle.tools import run_tool_calls, tool
from treadle.tools.tool import bounded
from treadle.tools.toolset import ToolSet


async def _at_once() -> str:
    return "done"


async def test_a_call_that_never_waits_arms_no_timer() -> None:
    loop = asyncio.get_running_loop()
    before = len(loop._scheduled)  # type: ignore[attr-defined]
    assert await bounded(_at_once(), 5.0) == ("done", False)
    assert len(loop._scheduled) == before  # type: ignore[attr-defined]


async def test_a_call_that_waits_past_its_limit_is_cancelled_where_it_waits() -> None:
    seen: list[str] = []

    async def slow() -> str:
        seen.append("started")
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            seen.append("cancelled")
            raise
        return "late"

    assert await bounded(slow(), 0.01) == (None, True)
    assert seen == ["started", "cancelled"]


async def test_a_call_that_waits_and_finishes_in_time_gives_its_result() -> None:
    async def waits() -> int:
        await anyio.lowlevel.checkpoint()
        await asyncio.sleep(0)
        return 7

    assert await bounded(waits(), 5.0) == (7, False)


@pytest.mark.parametrize("where", ["first step", "after a wait"])
async def test_a_call_s_exception_propagates(where: str) -> None:
    async def fails() -> None:
        if where == "after a wait":
            await anyio.lowlevel.checkpoint()
        raise ValueError(where)

    with pytest.raises(ValueError, match=where):
        await bounded(fails(), 5.0)


async def test_a_call_past_its_deadline_before_it_waits_times_out_at_its_first_wait() -> None:
    async def waits() -> str:
        await anyio.sleep(10)
        return "late"

    assert await bounded(waits(), -1.0) == (None, True)
    assert await bounded(_at_once(), -1.0) == ("done", False)  # never waited: nothing to stop


async def test_a_call_that_swallows_one_cancellation_keeps_its_answer() -> None:
    # As under `anyio.move_on_after`: the call decides what a cancellation thrown in means.
    async def stubborn() -> str:
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            return "kept"
        return "late"

    result, _ = await bounded(stubborn(), 0.01)
    assert result == "kept"


async def test_an_awaitable_that_is_not_a_coroutine_is_bounded_too() -> None:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    assert await bounded(future, 0.01) == (None, True)
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result(3)
    assert await bounded(done, 5.0) == (3, False)


async def test_the_pass_s_cancellation_is_not_a_timeout() -> None:
    async def waits() -> str:
        await anyio.sleep(10)
        return "late"

    with anyio.move_on_after(0.01) as outer:
        await bounded(waits(), 60.0)
    assert outer.cancelled_caught


async def test_a_tool_that_returns_at_once_and_one_that_overruns_in_one_round() -> None:
    @tool(timeout=0.05)
    async def quick(x: int) -> int:
        """Answers at once."""
        return x + 1

    @tool(timeout=0.05)
    async def slow() -> None:
        """Waits too long."""
        await anyio.sleep(10)

    calls = [
        {"id": "a", "type": "function", "function": {"name": "quick", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "slow", "arguments": "{}"}},
    ]
    outs = await run_tool_calls(calls, ToolSet([quick, slow]), session=None)
    assert [o.error_kind for o in outs] == [None, "timeout"]
    assert outs[0].content == '{"ok":true,"result":2}'


async def test_a_call_that_waits_inside_its_own_cancel_scopes_runs_as_before() -> None:
    # The timer of a call that waits comes after the call entered scopes of its own: it must
    # not sit inside them (an anyio scope opened there broke their exit order).
    async def scoped() -> str:
        with anyio.fail_after(5), anyio.CancelScope():
            await anyio.sleep(0.001)
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.sleep, 0.001)
        return "ok"

    assert await bounded(scoped(), 5.0) == ("ok", False)

    async def scoped_slow() -> str:
        with anyio.fail_after(5):
            await anyio.sleep(10)
        return "late"

    assert await bounded(scoped_slow(), 0.01) == (None, True)

    async def own_timeout() -> str:
        with anyio.fail_after(0.001):
            await anyio.sleep(10)
        return "late"

    with pytest.raises(TimeoutError):
        await bounded(own_timeout(), 5.0)
