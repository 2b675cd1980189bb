"""`ToolContext` injection is by type, never by type name."""

from __future__ import annotations

import json
import time

import pydantic

from treadle import Limits, Session, run_session_loop
from treadle.testing.scripted import ScriptedExecutor, text, tool_call
from treadle.tools import ToolContext, tool


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
