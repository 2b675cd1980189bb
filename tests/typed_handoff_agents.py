"""Importable agents whose handoff target answers with another output type than the agent the
pass started with, for the process backend's tests: workers import them by path
(`typed_handoff_agents:routed`), as the driver's `sys.path` (with tests/) crosses to them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.testing import Reply


class Verdict(BaseModel):
    """The target's answer."""

    who: str
    score: float


class Label(BaseModel):
    """The routing agent's own answer type (never given here: it hands off)."""

    label: str


judge = Agent("judge", "Judge.", provider=Provider(model="fake"), output_type=Verdict)
routed = Agent(
    "routed", "Route.", provider=Provider(model="fake"), output_type=Label, handoffs=[judge]
)
"""Typed as `Label`, but the judge answers (a `Verdict`)."""
untyped = Agent("untyped", "Route.", provider=Provider(model="fake"), handoffs=[judge])
"""No output type of its own; the judge answers (a `Verdict`)."""


def script(request: dict[str, Any]) -> Reply:
    """The router transfers to the judge on a user message saying `judge`, else answers a
    `Label`; the judge answers a `Verdict`."""
    messages = request["messages"]
    if messages[0]["content"] == "Judge.":
        return Reply.tool_call("final_result", {"who": "B", "score": 0.5})
    if any(m["role"] == "user" and "judge" in str(m["content"]) for m in messages):
        return Reply.tool_call("transfer_to_judge", {})
    return Reply.tool_call("final_result", {"label": "kept"})
