"""Compaction: summarise the older rows of a long session, keep the last turns verbatim; and an
agent that compacts on its own when the estimated context reaches `compact_at_tokens`."""

from typing import Any

from treadle import Session
from treadle.agents import Agent, run_session_compress
from treadle.loop import CompletionRequest
from treadle.testing.scripted import ScriptedExecutor, text


def fake_model(request: CompletionRequest) -> dict[str, Any]:
    if "<conversation>" in str(request.rows[0].content):  # the summariser's request
        return text("The user planned a trip to Lisbon in May; budget 1,200 EUR.")
    return text("Book the 9:40 train.")


long_chat = Session.from_messages(
    [{"role": "system", "content": "You are a travel agent."}]
    + [{"role": "user", "content": f"detail {i} " + "." * 300} for i in range(12)]
)
agent_session = Session.from_agent_prompt("You are a travel agent.")
short = run_session_compress(
    long_chat, agent_session, executor=ScriptedExecutor(default=fake_model), keep_last=2
)
for row in short.rows:
    print(f"{row.kind:7} {str(row.content)[:70]}")
assert len(short.rows) == 4  # system row, summary row, two kept rows

planner = Agent(
    "planner", "You are a travel agent.", executor=ScriptedExecutor(default=fake_model),
    compact_at_tokens=500, compact_keep_last=2,
)  # fmt: skip
out = planner(long_chat.add_user_message("Which train?"))
print(out.final_text, "| rows after automatic compaction:", len(out.rows))
assert out.final_text == "Book the 9:40 train." and len(out.rows) == 5
