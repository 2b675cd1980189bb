"""Small importable tools and a matching fake-model script, for distributed tests and examples.

Workers of `backend="process"` or `"ray"` import tools by path (`package.module:function`), so
tools used in tests and docs must live in a real module: these do. `shout_script` is a stateless,
deterministic `FakeOpenAIServer` script (fixed tool-call ids), so the same session gives the same
transcript on any backend. This module must never do I/O at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from treadle.testing.fake_replies import Reply, ToolCallSpec
from treadle.tools import tool

if TYPE_CHECKING:
    from treadle.agents import Agent

__all__ = ["shout", "shout_inputs", "shout_script", "shouter"]


@tool
def shout(text: str) -> str:
    """Return the text in upper case.

    Args:
        text: What to shout.
    """
    return text.upper()


def shout_script(request: dict[str, Any]) -> Reply:
    """Call `shout` on the last user message, then answer with what it returned."""
    messages = request.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        return Reply.text(f"shouted: {last.get('content')}")
    text = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    arguments = '{"text": ' + _quote(str(text)) + "}"
    return Reply(tool_calls=(ToolCallSpec("shout", arguments, id="call_shout_1"),))


def _quote(text: str) -> str:
    from pydantic_core import to_json

    return to_json(text).decode()


def shouter(base_url: str, **provider: Any) -> Agent:
    """An `Agent` that shouts through `shout`, against the endpoint at `base_url`."""
    from treadle.agents import Agent
    from treadle.llm import Provider

    return Agent(
        "shouter",
        "Shout what the user says.",
        tools=[shout],
        provider=Provider(model="fake", base_url=base_url, **provider),
    )


def shout_inputs(n: int) -> list[Any]:
    """`n` map inputs; every other one has a sandbox placement, so workers make (and must remove)
    directories."""
    from treadle.session import Session

    return [
        Session.from_user_message(f"item {i}").to("local") if i % 2 else f"item {i}"
        for i in range(n)
    ]
