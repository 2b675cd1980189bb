"""Issue 28's review, second part: dynamic instructions given the typed context, `is_enabled`
bounded by the deadline and failing clearly, a forced choice of a disabled tool not sent, and
options refused at configuration (`StopAtTools` of no tool, a bool token budget).

Every pass talks HTTP to the fake server; what the model saw is read back from its requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import pytest
from pydantic import Field

from test_tool_policies import AGENT, _provider
from treadle import (
    Agent,
    ConfigurationError,
    Limits,
    Provider,
    Session,
    StopAtTools,
    ToolArgumentsError,
    ToolContext,
    ToolEnabledError,
    run_session_loop,
    tool,
)
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply


@dataclass
class Caller:
    name: str


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def test_dynamic_instructions_receive_the_typed_context(server: FakeOpenAIServer) -> None:
    seen: list[object] = []

    def instructions(context: ToolContext[Caller]) -> str:
        seen.append(context.session)
        return f"You help {context.deps.name}."

    server.enqueue(Reply.text("hello"))
    agent = Agent("a", instructions, provider=_provider(server), deps_type=Caller)
    out = agent("hi", deps=Caller("ada"))
    assert out.final_text == "hello"
    assert server.requests[-1].body["messages"][0] == {
        "role": "system",
        "content": "You help ada.",
    }
    [session] = seen
    assert isinstance(session, Session) and session.rows[-1].payload["content"] == "hi"


def test_dynamic_instructions_of_the_session_still_get_the_session(
    server: FakeOpenAIServer,
) -> None:
    def instructions(user: Session) -> str:
        return f"The user said {user.rows[-1].payload['content']}."

    server.enqueue(Reply.text("ok"))
    Agent("a", instructions, provider=_provider(server))("hi").synchronize()
    assert server.requests[-1].body["messages"][0]["content"] == "The user said hi."


def test_a_hanging_is_enabled_is_cancelled_at_the_pass_deadline(server: FakeOpenAIServer) -> None:
    ended: list[str] = []

    async def slow(context: ToolContext) -> bool:
        try:
            await anyio.sleep(120)  # far past the deadline: only a cancellation ends it early
        except anyio.get_cancelled_exc_class():
            ended.append("cancelled")
            raise
        ended.append("returned")
        return True

    gated = tool(name="gated", is_enabled=slow)(add.fn)
    server.enqueue(Reply.text("never asked"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[gated], limits=Limits(deadline_seconds=0.5),
    )  # fmt: skip
    assert out.stop_reason == "deadline"
    assert ended == ["cancelled"]  # not let run to its end: the pass was not held past it


def test_a_raising_is_enabled_fails_the_pass_naming_the_tool(server: FakeOpenAIServer) -> None:
    def broken(context: ToolContext) -> bool:
        raise RuntimeError("rule store down")

    gated = tool(name="gated", is_enabled=broken)(add.fn)
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[gated]
    )
    with pytest.raises(ToolEnabledError, match="tool 'gated'") as caught:
        out.synchronize()
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert not server.requests


def test_a_zero_argument_is_enabled_is_refused_at_configuration() -> None:
    no_argument: Any = lambda: True  # noqa: E731 - mypy refuses it too; this is the runtime check
    with pytest.raises(ConfigurationError, match="is_enabled must take one argument"):
        tool(name="gated", is_enabled=no_argument)(add.fn)
    tool(name="ok", is_enabled=lambda context: True)(add.fn)  # one argument: accepted


def test_a_forced_choice_of_a_disabled_tool_is_not_sent(server: FakeOpenAIServer) -> None:
    off = tool(name="off", is_enabled=False)(add.fn)
    forced = {"type": "function", "function": {"name": "off"}}
    server.enqueue(Reply.text("answered"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT,
        agent_provider=_provider(server, tool_choice=forced), tools=[off, add],
    )  # fmt: skip
    assert out.final_text == "answered"
    body = server.requests[0].body
    assert body["tool_choice"] == "auto"
    assert [t["function"]["name"] for t in body["tools"]] == ["add"]


def test_a_forced_choice_of_an_offered_tool_is_sent(server: FakeOpenAIServer) -> None:
    forced = {"type": "function", "function": {"name": "add"}}
    server.enqueue(Reply.tool_call("add", {"a": 1, "b": 2}), Reply.text("3"))
    run_session_loop(
        Session.from_user_message("go"), AGENT,
        agent_provider=_provider(server, tool_choice=forced), tools=[add],
    ).synchronize()  # fmt: skip
    assert [r.body.get("tool_choice") for r in server.requests] == [forced, "auto"]


def test_stop_at_tools_naming_no_tool_is_refused_at_the_start(server: FakeOpenAIServer) -> None:
    with pytest.raises(ConfigurationError, match="'zzz'"):
        run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
            tools=[add], tool_use_behavior=StopAtTools("add", "zzz"),
        )  # fmt: skip
    assert not server.requests


@pytest.mark.parametrize("bad", [True, False, 0, -5, 1.5, "10"])
def test_a_token_budget_that_is_not_a_positive_int_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="budget_total_tokens"):
        Provider(model="m", budget_total_tokens=bad)  # type: ignore[arg-type]


def test_an_on_error_function_of_exception_decides_the_message(server: FakeOpenAIServer) -> None:
    def explain(error: Exception) -> str:
        return f"explained: {error}"

    @tool(on_error=explain)
    def failing(q: str) -> str:
        """Fail."""
        raise ValueError(q)

    server.enqueue(Reply.tool_call("failing", {"q": "boom"}), Reply.text("ok"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[failing]
    )
    [row] = [r for r in out.rows if r.kind == "tool_result"]
    assert json.loads(row.payload["content"])["message"] == "explained: boom"


def test_kwargs_values_are_validated_against_their_annotation(server: FakeOpenAIServer) -> None:
    @tool
    def total(a: int, **more: int) -> int:
        """Sum the numbers."""
        return a + sum(more.values())

    assert total.parameters["additionalProperties"] == {"type": "integer"}
    assert total.validate({"a": 1, "b": "2"}) == {"a": 1, "b": 2}  # lax mode, as named ones
    with pytest.raises(ToolArgumentsError, match="b"):
        total.validate({"a": 1, "b": "not a number"})
    server.enqueue(
        Reply.tool_calls_of([("total", {"a": 1, "b": 2}), ("total", {"a": 1, "b": "x"})]),
        Reply.text("ok"),
    )
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[total]
    )
    good, bad = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert good == {"ok": True, "result": 3}
    assert bad["error_kind"] == "invalid_tool_arguments"


def test_untyped_kwargs_stay_open() -> None:
    @tool
    def anything(a: int, **more: Any) -> int:
        """Take anything."""
        return a

    assert anything.parameters["additionalProperties"] is True
    assert anything.validate({"a": 1, "b": [1, "x"]}) == {"a": 1, "b": [1, "x"]}


def test_a_field_alias_is_refused_clearly() -> None:
    def aliased(q: int = Field(alias="query")) -> int:
        """Aliased."""
        return q

    def annotated(q: Annotated[int, Field(validation_alias="query")]) -> int:
        """Annotated alias."""
        return q

    for fn in (aliased, annotated):
        with pytest.raises(ConfigurationError, match="parameter 'q' sets Field"):
            tool(fn)
