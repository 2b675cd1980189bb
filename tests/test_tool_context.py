"""`ToolContext` injection is by type, never by type name."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import pydantic

from treadle import Limits, Session, run_session_loop
from treadle.testing.scripted import ScriptedExecutor, text, tool_call, tool_calls
from treadle.tools import BaseTool, Tool, ToolContext, tool


class Sandbox(pydantic.BaseModel):
    """A user's own model that happens to be called Sandbox: an ordinary argument."""

    size: int


def test_a_user_class_named_like_ours_is_not_injected() -> None:
    @tool
    def measure(box: Sandbox) -> int:
        """Measure a box."""
        return box.size

    assert dict(measure.injected) == {}
    assert "box" in measure.parameters["properties"]


def test_context_reaches_a_tool_inside_a_pass() -> None:
    seen: list[ToolContext] = []

    @tool
    def probe(context: ToolContext) -> dict[str, object]:
        """Report the context."""
        seen.append(context)
        return {"left": context.seconds_left() is not None}

    assert "context" not in probe.parameters["properties"]
    ex = ScriptedExecutor([tool_call("probe", {}), text("ok")])
    out = run_session_loop(
        Session.from_user_message("x"),
        Session.from_agent_prompt("a"),
        executor=ex,
        tools=[probe],
        limits=Limits(deadline_seconds=60),
    )
    assert out.final_text == "ok"
    assert json.loads(out.rows[2].payload["content"]) == {"ok": True, "left": True}
    [context] = seen
    assert context.pass_id == out.id and context.call is not None
    assert context.call.name == "probe" and context.session is not None
    assert context.deadline is not None and context.deadline > time.monotonic()


def _round_with(*tools: Tool) -> Session:
    """A pass whose first reply calls every tool given (by name), then answers."""
    names = [t.name for t in tools]
    ex = ScriptedExecutor([tool_calls([(n, {}) for n in names]), text("ok")])
    return run_session_loop(
        Session.from_user_message("x"), Session.from_agent_prompt("a"), executor=ex, tools=tools
    )


def test_a_round_of_plain_and_context_tools_shows_the_session_to_those_asking() -> None:
    # A round of tools that ask for nothing builds no snapshot of the output; a tool in the same
    # round that asks for the context, the session, or reads it in its own `invoke` still sees
    # the output so far (the user's row and the assistant row calling it).
    seen: dict[str, Session | None] = {}

    @tool
    def plain() -> str:
        """Ask for nothing."""
        return "p"

    @tool
    def with_context(context: ToolContext) -> str:
        """Ask for the context."""
        seen["context"] = context.session
        return "c"

    class WithSession(BaseTool):
        name = "with_session"

        def __call__(self, session: Session) -> str:
            seen["session"] = session
            return "s"

    class OwnInvoke(Tool):
        name = "own_invoke"
        description = "Read the context in its own invoke."
        parameters: dict[str, object] = {"type": "object", "properties": {}}

        def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
            return dict(arguments)

        async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
            seen["invoke"] = context.session
            return "i"

    out = _round_with(plain, with_context, WithSession(), OwnInvoke())
    assert out.final_text == "ok"
    results = [json.loads(r.payload["content"])["result"] for r in out.rows[2:6]]
    assert results == ["p", "c", "s", "i"]
    for key in ("context", "session", "invoke"):
        session = seen[key]
        assert session is not None, key
        assert [r.kind for r in session.rows] == ["user", "assistant"], key


def test_a_round_of_plain_tools_alone_still_runs_them_all() -> None:
    calls: list[str] = []

    @tool
    def first() -> str:
        """Ask for nothing."""
        calls.append("first")
        return "1"

    class Second(BaseTool):
        name = "second"

        def __call__(self) -> str:
            calls.append("second")
            return "2"

    out = _round_with(first, Second())
    assert out.final_text == "ok" and sorted(calls) == ["first", "second"]
    assert [json.loads(r.payload["content"])["result"] for r in out.rows[2:4]] == ["1", "2"]


def test_a_tool_whose_invoke_is_wrapped_on_the_instance_sees_the_session() -> None:
    # A tracing wrapper put on one tool's `invoke` may read the context: not one of the
    # `invoke`s known to hand a tool only what it asks for, so the round builds the snapshot.
    seen: list[Session | None] = []

    @tool
    def traced() -> str:
        """Ask for nothing."""
        return "t"

    inner = traced.invoke

    async def wrapper(arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        seen.append(context.session)
        return await inner(arguments, context=context)

    traced.invoke = wrapper  # type: ignore[method-assign]
    out = _round_with(traced)
    assert out.final_text == "ok"
    [session] = seen
    assert session is not None and [r.kind for r in session.rows] == ["user", "assistant"]
