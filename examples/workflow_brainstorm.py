"""A brainstorm: two agents take turns appending to one shared session (ScriptedExecutor)."""

from treadle.agents import Agent, brainstorm
from treadle.testing.scripted import ScriptedExecutor, text


def voice(name: str) -> ScriptedExecutor:
    # Each fake agent answers with its name and how many rows it has seen so far.
    return ScriptedExecutor(default=lambda request: text(f"{name}: idea #{len(request.rows)}"))


optimist = Agent("optimist", "Propose bold ideas.", executor=voice("optimist"))
skeptic = Agent("skeptic", "Point out risks in the last idea.", executor=voice("skeptic"))
out = brainstorm(optimist, skeptic, rounds=2)("How could we halve our build times?")
for row in out.rows:
    print(f"{row.kind:9} {row.content}")
assert [r.content.split(":")[0] for r in out.rows[1:]] == ["optimist", "skeptic"] * 2
