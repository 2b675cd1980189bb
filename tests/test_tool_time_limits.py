"""A tool call's time limit is an anyio cancel scope around the whole call (tools/dispatch.py).

The scope is level-triggered: once the limit passes, every wait of the call is cancelled, not
only the one it was in, so a tool that waits again after its cancellation (cleanup in an
`except`, a retry, a task group whose child failed near the limit, a nested pass) still stops at
its limit with a `timeout` result. A shielded part of the tool runs to its end, and the tool sees
its deadline (`anyio.current_effective_deadline()`). Issue 33's fifth round tried a timer armed at
the call's first wait (asyncio's edge-triggered timeout) and broke each of these; these tests are
why it was reverted (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import anyio
import anyio.lowlevel

from treadle import Provider, Session, arun_session_loop, tool
from treadle.agents.agent import Agent
from treadle.loop.control import Limits
from treadle.testing import FakeOpenAIServer, tool_loop
from treadle.testing.fake_replies import Reply
from treadle.tools import run_tool_calls
from treadle.tools.tool import Tool
from treadle.tools.toolset import ToolSet

LIMIT = 0.2
Cancelled = asyncio.CancelledError  # the runtime is asyncio


def _call(name: str, arguments: str = "{}", call_id: str = "a") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


async def _run(tool_: Tool) -> tuple[str | None, str]:
    """`(error_kind, content)` of one call of `tool_`."""
    (out,) = await run_tool_calls([_call(tool_.name)], ToolSet([tool_]), session=None)
    return out.error_kind, out.content


def _tool_kinds(out: Session) -> list[str | None]:
    return [
        json.loads(str(row.content)).get("error_kind")
        for row in out.rows
        if getattr(row, "role", None) == "tool"
    ]


# -- a call that waits past its limit ------------------------------------------------------------
async def test_a_call_that_waits_past_its_limit_is_cancelled_where_it_waits() -> None:
    seen: list[str] = []

    @tool(timeout=LIMIT)
    async def slow() -> str:
        """Waits too long."""
        seen.append("started")
        try:
            await anyio.sleep(10)
        except Cancelled:
            seen.append("cancelled")
            raise
        return "late"

    kind, content = await _run(slow)
    assert kind == "timeout"
    assert "ran past its 0.2 s" in content
    assert seen == ["started", "cancelled"]


async def test_a_call_that_waits_and_finishes_in_time_gives_its_result() -> None:
    @tool(timeout=5)
    async def waits() -> int:
        """Waits briefly."""
        await anyio.lowlevel.checkpoint()
        await asyncio.sleep(0)
        return 7

    assert await _run(waits) == (None, '{"ok":true,"result":7}')


async def test_a_tool_that_returns_at_once_and_one_that_overruns_in_one_round() -> None:
    @tool(timeout=LIMIT)
    async def quick(x: int) -> int:
        """Answers at once."""
        return x + 1

    @tool(timeout=LIMIT)
    async def slow() -> None:
        """Waits too long."""
        await anyio.sleep(10)

    calls = [_call("quick", '{"x": 1}', "a"), _call("slow", "{}", "b")]
    outs = await run_tool_calls(calls, ToolSet([quick, slow]), session=None)
    assert [o.error_kind for o in outs] == [None, "timeout"]
    assert outs[0].content == '{"ok":true,"result":2}'


async def test_a_call_that_turns_its_cancellation_into_an_answer_keeps_it() -> None:
    # The tool decides what a cancellation means: an answer it returns instead is its answer.
    @tool(timeout=LIMIT)
    async def stubborn() -> str:
        """Answers when cancelled."""
        try:
            await anyio.sleep(10)
        except Cancelled:
            return "kept"
        return "late"

    assert await _run(stubborn) == (None, '{"ok":true,"result":"kept"}')


async def test_the_pass_s_cancellation_is_not_a_timeout() -> None:
    @tool(timeout=60)
    async def waits() -> str:
        """Waits long."""
        await anyio.sleep(10)
        return "late"

    with anyio.move_on_after(0.01) as outer:
        await _run(waits)
    assert outer.cancelled_caught


async def test_a_call_that_waits_inside_its_own_cancel_scopes_runs_as_before() -> None:
    @tool(timeout=5)
    async def scoped() -> str:
        """Its own scopes and a task group, all in time."""
        with anyio.fail_after(5), anyio.CancelScope():
            await anyio.sleep(0.001)
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.sleep, 0.001)
        return "ok"

    @tool(timeout=LIMIT)
    async def scoped_slow() -> str:
        """Its own longer limit inside the call's."""
        with anyio.fail_after(5):
            await anyio.sleep(10)
        return "late"

    @tool(timeout=5)
    async def own_timeout() -> str:
        """Its own shorter limit: its own TimeoutError, not the call's timeout."""
        with anyio.fail_after(0.001):
            await anyio.sleep(10)
        return "late"

    assert await _run(scoped) == (None, '{"ok":true,"result":"ok"}')
    assert (await _run(scoped_slow))[0] == "timeout"
    kind, content = await _run(own_timeout)
    assert kind != "timeout"
    assert "TimeoutError" in content


# -- a call that waits again after its cancellation (level-triggered) ----------------------------
async def _wait_then_clean_up(seen: list[str]) -> str:
    """Waits; when cancelled, waits again to clean up and says in `seen` how that ended."""
    try:
        await anyio.sleep(10)
    except asyncio.CancelledError:
        try:
            await anyio.sleep(10)
            seen.append("cleanup ran to its end")
        except asyncio.CancelledError:
            seen.append("cleanup cancelled")
        raise
    return "late"


async def test_a_tool_that_waits_in_its_cleanup_is_cancelled_there_too() -> None:
    seen: list[str] = []

    @tool(timeout=LIMIT)
    async def cleanup() -> str:
        """Cleans up (with a wait) when cancelled."""
        return await _wait_then_clean_up(seen)

    assert (await _run(cleanup))[0] == "timeout"
    assert seen == ["cleanup cancelled"]


async def test_a_tool_that_retries_after_its_cancellation_gets_no_further_wait() -> None:
    @tool(timeout=LIMIT)
    async def retry() -> str:
        """Retries on any error, a cancellation too (a bare except)."""
        for attempt in range(3):
            try:
                await anyio.sleep(1)
                return f"attempt {attempt} ok"
            except BaseException:
                continue
        return "gave up"

    # Every attempt after the limit is cancelled at its first wait: no attempt completes.
    assert await _run(retry) == (None, '{"ok":true,"result":"gave up"}')


async def test_a_task_group_whose_child_fails_near_the_limit_still_times_out() -> None:
    # The child fails just before the limit, in the same few loop turns as the timer: however the
    # two land, the tool's next wait is past its limit and is cancelled.
    offsets = [i * 1e-4 for i in range(-16, -2, 4)]
    ran_past: list[float] = []

    def grouped_tool(offset: float) -> Tool:
        async def child() -> None:
            await asyncio.sleep(LIMIT + offset)
            raise ValueError("child failed")

        @tool(timeout=LIMIT, name="grouped")
        async def grouped() -> str:
            """A task group whose child fails near the limit."""
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(child())
                    await asyncio.sleep(5)
            except* ValueError:
                pass
            await asyncio.sleep(0.3)
            ran_past.append(offset)
            return "continued past the limit"

        return grouped

    for offset in offsets:  # a batch of calls at once per offset, as a loaded round has
        kinds = await asyncio.gather(*[_run(grouped_tool(offset)) for _ in range(20)])
        assert [k for k, _ in kinds] == ["timeout"] * len(kinds)
    assert ran_past == []


def _cleaning(seen: list[str]) -> Tool:
    @tool
    async def cleaner(round: int) -> str:
        """Cleans up (with a wait) when cancelled."""
        return await _wait_then_clean_up(seen)

    return cleaner


async def test_the_pass_deadline_stops_a_tool_that_waits_in_its_cleanup() -> None:
    seen: list[str] = []
    with FakeOpenAIServer(script=tool_loop(1, "cleaner")) as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k")
        out = await arun_session_loop(
            Session.from_user_message("go"),
            Session.from_agent_prompt("x"),
            agent_provider=provider,
            tools=[_cleaning(seen)],
            limits=Limits(deadline_seconds=LIMIT),
        )
    assert out.stop_reason == "deadline"
    assert seen == ["cleanup cancelled"]


async def test_an_agent_as_tool_times_out_with_its_sub_pass_s_cleanup() -> None:
    def manager(request: dict[str, Any]) -> Reply:
        if not any(m.get("role") == "tool" for m in request.get("messages") or []):
            return Reply.tool_call("sub", {"task": "do it"})
        return Reply.text("done")

    seen: list[str] = []
    with (
        FakeOpenAIServer(script=manager) as outer,
        FakeOpenAIServer(script=tool_loop(1, "cleaner")) as inner,
    ):
        sub = Agent(
            "sub",
            "x",
            tools=[_cleaning(seen)],
            provider=Provider(model="m", base_url=inner.base_url, api_key="k"),
        )
        out = await arun_session_loop(
            Session.from_user_message("go"),
            Session.from_agent_prompt("x"),
            agent_provider=Provider(model="m", base_url=outer.base_url, api_key="k"),
            tools=[sub.as_tool()],
            limits=Limits(tool_timeout_seconds=LIMIT),
        )
    assert _tool_kinds(out) == ["timeout"]
    assert seen == ["cleanup cancelled"]


# -- shields and the deadline a tool sees --------------------------------------------------------
async def test_a_shielded_part_of_a_tool_runs_to_its_end_past_the_limit() -> None:
    seen: list[str] = []

    @tool(timeout=LIMIT)
    async def shielded() -> str:
        """Flushes something that must finish, under a shield."""
        await anyio.lowlevel.checkpoint()
        with anyio.CancelScope(shield=True):
            try:
                await anyio.sleep(LIMIT * 1.5)
            except BaseException as error:
                seen.append(f"interrupted by {type(error).__name__}")
                raise
            seen.append("finished")
        await anyio.sleep(10)
        return "late"

    assert (await _run(shielded))[0] == "timeout"
    assert seen == ["finished"]


async def test_a_tool_sees_its_deadline() -> None:
    @tool(timeout=5)
    async def sees() -> float:
        """Reports how long it has left."""
        return anyio.current_effective_deadline() - anyio.current_time()

    @tool(timeout=5)
    async def sees_after_a_wait() -> float:
        """Reports how long it has left, after a wait."""
        await anyio.lowlevel.checkpoint()
        return anyio.current_effective_deadline() - anyio.current_time()

    for each in (sees, sees_after_a_wait):
        kind, content = await _run(each)
        assert kind is None
        left = json.loads(content)["result"]
        assert isinstance(left, float)
        assert math.isfinite(left)
        assert 0 < left <= 5
