"""A custom executor's `dispatch_tool` goes through the one dispatcher: same validation, timeouts,
lanes, approvals and unknown-outcome handling as the tools' own implementations."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import anyio

from treadle import Session, run_session_loop
from treadle.session import ToolCall
from treadle.testing.scripted import ScriptedExecutor, text, tool_call
from treadle.tools import ToolContext, ToolSet, run_tool_calls, tool

AGENT = Session.from_agent_prompt("Use tools.")


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool(timeout=0.2)
def slow() -> str:
    """Never finishes in time when dispatched by the executor below."""
    return "fast"


@tool(resource_key="ledger")
def book(n: int) -> int:
    """Book entry `n` (calls on the ledger run one at a time, in call order)."""
    return n


class Dispatching:
    """An async tool executor that records what it was asked to run."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.log: list[str] = []

    async def adispatch_tool(self, session: Session | None, tool: Any, arguments: Any) -> Any:
        self.seen.append((tool.name, arguments))
        if tool.name == "slow":
            await anyio.sleep(30)
        if tool.name == "book":
            self.log.append(f"start {arguments['n']}")
            await anyio.sleep(0.01 * (3 - arguments["n"]))  # later calls would finish first
            self.log.append(f"end {arguments['n']}")
        return {"dispatched": tool.name, "args": arguments}


def _body(outcome: Any) -> dict[str, Any]:
    return json.loads(outcome.content)  # type: ignore[no-any-return]


def _call(i: int, name: str, **arguments: Any) -> ToolCall:
    return ToolCall(f"c{i}", name, json.dumps(arguments))


async def test_arguments_are_validated_before_a_custom_executor_sees_them() -> None:
    ex = Dispatching()
    good, bad = await run_tool_calls(
        [_call(1, "add", a="1", b=2), _call(2, "add", a="one", b=2)],
        ToolSet([add]),
        executor=ex,
    )
    assert _body(good) == {"ok": True, "dispatched": "add", "args": {"a": 1, "b": 2}}
    assert bad.error_kind == "invalid_tool_arguments" and "a:" in _body(bad)["message"]
    assert ex.seen == [("add", {"a": 1, "b": 2})]  # the invalid call never reached it


async def test_the_tool_timeout_bounds_a_custom_dispatch() -> None:
    with anyio.fail_after(20):  # hang guard only
        [out] = await run_tool_calls([_call(1, "slow")], ToolSet([slow]), executor=Dispatching())
    assert out.error_kind == "timeout"


async def test_resource_key_lanes_order_custom_dispatch() -> None:
    ex = Dispatching()
    outs = await run_tool_calls(
        [_call(i, "book", n=i) for i in range(3)], ToolSet([book]), executor=ex
    )
    assert [o.ok for o in outs] == [True, True, True]
    assert ex.log == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2"]


async def test_denied_and_unknown_outcome_calls_are_not_dispatched() -> None:
    ex = Dispatching()
    denied, unknown, ran = await run_tool_calls(
        [_call(1, "add", a=1, b=1), _call(2, "add", a=2, b=2), _call(3, "add", a=3, b=3)],
        ToolSet([add]),
        executor=ex,
        denied={"c1": "not today"},
        unknown_outcome={"c2"},
        context=ToolContext(pass_id="p"),
    )
    assert denied.error_kind == "denied" and "not today" in _body(denied)["message"]
    assert unknown.error_kind == "unknown_outcome"
    assert ran.ok and ex.seen == [("add", {"a": 3, "b": 3})]


def test_sync_dispatch_runs_off_the_event_loop_through_a_pass() -> None:
    class SyncDispatching(ScriptedExecutor):
        def __init__(self, replies: list[Any]) -> None:
            super().__init__(replies)
            self.threads: list[str] = []

        def dispatch_tool(self, session: Session | None, tool: Any, arguments: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            time.sleep(0.01)  # blocking is fine here: this runs on a worker thread
            return {"sum": arguments["a"] + arguments["b"]}

    ex = SyncDispatching([tool_call("add", {"a": 2, "b": "3"}), text("done")])
    out = run_session_loop(Session.from_user_message("x"), AGENT, executor=ex, tools=[add])
    assert out.final_text == "done"
    assert json.loads(out.rows[2].payload["content"]) == {"ok": True, "sum": 5}
    assert ex.threads and ex.threads[0] != "treadle-runtime"
