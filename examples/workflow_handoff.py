"""Triage: a router agent picks a specialist (a Literal field); the specialist answers fresh.

(A handoff that continues the same transcript is `Agent(handoffs=[...])`: docs/agents.md.)"""

from typing import Literal

from pydantic import BaseModel

from treadle.agents import Agent, triage
from treadle.testing.scripted import ScriptedExecutor, text, tool_call


class Route(BaseModel):
    department: Literal["billing", "tech"]
    reason: str


router = Agent(
    "triage",
    "Route the customer to billing or tech.",
    executor=ScriptedExecutor(
        [tool_call("final_result", {"department": "tech", "reason": "hardware fault"})]
    ),
    output_type=Route,
)
billing = Agent("billing", "Answer billing questions.", executor=ScriptedExecutor())
tech = Agent(
    "tech",
    "Fix technical problems.",
    executor=ScriptedExecutor([text("Hold the power button for 10 s.")]),
)

support = triage(router, {"billing": billing, "tech": tech})
out = support("My laptop will not turn on.")
print(out.metadata["handoff"])
print(out.final_text)
assert out.metadata["handoff"]["to"] == "tech"
assert out.chunk_table.kinds() == ["user", "assistant"]  # the specialist saw a fresh session
