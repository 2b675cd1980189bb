"""Importable agents with code parts (structured output, a validator, guardrails, hooks, a
handoff) and a matching fake-model script, for distributed tests and examples.

Workers of `backend="process"` or `"ray"` import such an agent by its path
(`treadle.testing.sample_agents:geographer`), so it must live in a real module: this one. The
agents take their endpoint from each worker's environment (`OPENAI_BASE_URL`,
`OPENAI_API_KEY`). `geographer_script` is stateless and deterministic. Hooks append one line per
call to the file named by `TREADLE_SAMPLE_HOOK_LOG` (when set), so a test can see that they ran
in the workers. This module must never do I/O at import time.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel

from treadle.agents import Agent
from treadle.errors import ModelRetry
from treadle.llm import Provider
from treadle.loop import Guardrail, GuardrailInput, HookContext, Hooks
from treadle.testing.fake_replies import Reply

__all__ = ["Capital", "FileHooks", "geographer", "geographer_script", "librarian"]


class Capital(BaseModel):
    """A country's capital."""

    country: str
    city: str


def capitalised(value: Capital) -> Capital:
    """Send the model back when the city is not capitalised."""
    if not value.city[:1].isupper():
        raise ModelRetry("write the city with a capital letter")
    return value


def no_forbidden(data: GuardrailInput) -> str | None:
    """Trip on a user message asking about a forbidden topic."""
    for row in data.session.rows:
        if row.kind == "user" and "forbidden" in str(row.content):
            return "forbidden topic"
    return None


class FileHooks(Hooks):
    """Appends `<hook> <agent>` to `$TREADLE_SAMPLE_HOOK_LOG` for each agent start and end."""

    def on_agent_start(self, ctx: HookContext) -> None:
        self._log(f"start {ctx.agent}")

    def on_agent_end(self, ctx: HookContext, output: Any) -> None:
        self._log(f"end {ctx.agent}")

    def _log(self, line: str) -> None:
        path = os.environ.get("TREADLE_SAMPLE_HOOK_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()} {line}\n")


librarian = Agent(
    "librarian",
    "You answer about books.",
    provider=Provider(model="fake"),
    output_type=Capital,
)
"""A handoff target: it answers with a `Capital` too."""

geographer = Agent(
    "geographer",
    "Name the capital.",
    provider=Provider(model="fake"),
    output_type=Capital,
    output_validators=[capitalised],
    guardrails=[Guardrail(no_forbidden, "input")],
    hooks=FileHooks(),
    handoffs=[librarian],
)
"""Structured output, a validator, an input guardrail, hooks and a handoff."""


def geographer_script(request: dict[str, Any]) -> Reply:
    """A first answer in lower case (the validator sends it back), then the right one; a user
    asking about books is handed to the librarian."""
    messages = request.get("messages") or []
    system = str(messages[0].get("content")) if messages else ""
    user = next((str(m.get("content")) for m in messages if m.get("role") == "user"), "")
    country = user.split()[-1]
    if "books" in user and "librarian" not in system and "books" not in system:
        return Reply.tool_call("transfer_to_librarian", {})
    retried = any(m.get("role") == "tool" and '"retry"' in str(m.get("content")) for m in messages)
    city = "Paris" if retried or "books" in system else "paris"
    return Reply.tool_call("final_result", json.dumps({"country": country, "city": city}))
