"""Per-tool error and timeout policies, `is_enabled`, `tool_use_behavior`, the tool_choice reset.

Every pass talks HTTP to the fake server; what the model saw is read back from the requests it
received.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from treadle import (
    ConfigurationError,
    Limits,
    Provider,
    Session,
    StopAtTools,
    ToolContext,
    ToolTimeoutError,
    run_session_loop,
    tool,
)
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply

AGENT = Session.from_agent_prompt("Use the tools.")


def _provider(server: FakeOpenAIServer, **kw: Any) -> Provider:
    return Provider(model="m", base_url=server.base_url, api_key="k", **kw)


def _results(out: Session) -> list[dict[str, Any]]:
    return [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]


class QuotaError(Exception):
    """A user's own error type."""


def _explain(error: BaseException) -> str:
    return f"quota reached ({error}); try tomorrow"


@tool(on_error=_explain)
def fetch(key: str) -> str:
    """Fetch a key."""
    raise QuotaError(f"no more fetches for {key}")


@tool(on_error="raise")
def strict_fetch(key: str) -> str:
    """Fetch a key, or fail the pass."""
    raise QuotaError(f"stop everything ({key})")


@tool
def add(a: int, b: int) -> int:
    """Add."""
    return a + b


def test_on_error_function_decides_what_the_model_sees(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.tool_call("fetch", {"key": "k1"}), Reply.text("ok"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[fetch]
    )
    assert out.final_text == "ok"
    [result] = _results(out)
    assert result == {
        "ok": False,
        "error_kind": "tool_execution_exception",
        "message": "quota reached (no more fetches for k1); try tomorrow",
    }


def test_on_error_raise_fails_the_pass_with_the_tools_exception(server: FakeOpenAIServer) -> None:
    server.enqueue(
        Reply.tool_calls_of([("add", {"a": 1, "b": 2}), ("strict_fetch", {"key": "k"})]),
        Reply.text("never"),
    )
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[add, strict_fetch],
    )  # fmt: skip
    with pytest.raises(QuotaError, match=r"stop everything \(k\)"):
        out.synchronize()
    assert len(server.requests) == 1  # the model was not asked again


def _failure_seen(server: FakeOpenAIServer, on_error: Any) -> str:
    """The message the model sees of a tool raising `ValueError("original")` under `on_error`."""

    @tool(on_error=on_error)
    def fails() -> None:
        """Fails."""
        raise ValueError("original")

    server.enqueue(Reply.tool_call("fails", {}), Reply.text("ok"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[fails]
    )
    [result] = _results(out)
    message: str = result["message"]
    return message


def test_a_broken_on_error_function_still_reports_the_call(server: FakeOpenAIServer) -> None:
    def broken(error: BaseException) -> str:
        raise RuntimeError("policy bug")

    message = _failure_seen(server, broken)
    assert "ValueError: original" in message and "policy bug" in message


def test_on_timeout_report_or_raise(server: FakeOpenAIServer) -> None:
    async def forever() -> str:
        await anyio.sleep_forever()
        return "never"

    reported = tool(name="slow", timeout=0.05)(forever)
    raising = tool(name="slow_raise", timeout=0.05, on_timeout="raise")(forever)
    server.enqueue(Reply.tool_call("slow", {}), Reply.text("ok"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[reported]
    )
    assert out.final_text == "ok" and _results(out)[0]["error_kind"] == "timeout"
    server.enqueue(Reply.tool_call("slow_raise", {}), Reply.text("never"))
    failed = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[raising]
    )
    with pytest.raises(ToolTimeoutError, match=r"slow_raise.*timeout"):
        failed.synchronize()


def test_policy_options_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="on_error"):
        tool(on_error="ignore")(add.fn)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="on_timeout"):
        tool(on_timeout="retry")(add.fn)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="is_enabled"):
        tool(is_enabled="yes")(add.fn)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="tool_use_behavior"):
        run_session_loop(
            Session.from_user_message("go"), AGENT,
            agent_provider=Provider(model="m", base_url="http://127.0.0.1:9/v1"),
            tool_use_behavior="stop",  # type: ignore[arg-type]
        )  # fmt: skip


@dataclass
class Account:
    admin: bool


def _is_admin(context: ToolContext[Account]) -> bool:
    return context.deps.admin


@tool(is_enabled=_is_admin)
def delete_everything() -> str:
    """Delete everything."""
    return "deleted"


@tool(is_enabled=False)
def hidden() -> str:
    """Never offered."""
    return "hidden"


def _offered(server: FakeOpenAIServer) -> list[str]:
    return [t["function"]["name"] for t in server.requests[-1].body.get("tools", ())]


@pytest.mark.parametrize("admin", [True, False])
def test_is_enabled_decides_per_pass_from_the_context(
    server: FakeOpenAIServer, admin: bool
) -> None:
    server.enqueue(Reply.tool_call("delete_everything", {}), Reply.text("ok"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[add, delete_everything, hidden], deps=Account(admin=admin),
    )  # fmt: skip
    assert out.final_text == "ok"
    assert _offered(server) == (["add", "delete_everything"] if admin else ["add"])
    [result] = _results(out)
    if admin:
        assert result == {"ok": True, "result": "deleted"}
    else:  # the model called a tool it was not offered: it is unknown in this round
        assert result["error_kind"] == "unknown_tool"


def test_is_enabled_async_function_is_asked_before_each_request(
    server: FakeOpenAIServer,
) -> None:
    asked: list[int] = []

    async def until_used(context: ToolContext) -> bool:
        asked.append(context.usage.requests)
        return context.usage.requests == 0

    once = tool(name="once", is_enabled=until_used)(add.fn)
    server.enqueue(Reply.tool_call("once", {"a": 1, "b": 1}), Reply.text("ok"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server), tools=[once]
    )
    assert out.final_text == "ok" and asked == [0, 1]
    assert "tools" not in server.requests[-1].body  # no tool left to offer


def test_stop_on_first_tool_makes_its_result_the_output(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.tool_calls_of([("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})]))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[add], tool_use_behavior="stop_on_first_tool",
    )  # fmt: skip
    assert out.stop_reason == "final_answer"
    assert out.output == {"ok": True, "result": 5}
    assert out.metadata["stopped_at_tool"]["name"] == "add"
    assert len(server.requests) == 1 and [r.kind for r in out.rows][-2:] == ["tool_result"] * 2


def test_stop_at_named_tools(server: FakeOpenAIServer) -> None:
    @tool
    def submit(answer: str) -> dict[str, str]:
        """Submit the answer."""
        return {"answer": answer}

    server.enqueue(
        Reply.tool_call("add", {"a": 1, "b": 2}),
        Reply.tool_calls_of([("add", {"a": 3, "b": 0}), ("submit", {"answer": "3"})]),
        Reply.text("never asked"),
    )
    out = run_session_loop(
        Session.from_user_message("go"), AGENT, agent_provider=_provider(server),
        tools=[add, submit], tool_use_behavior=StopAtTools("submit"),
    )  # fmt: skip
    assert out.stop_reason == "final_answer"
    assert out.output == {"ok": True, "answer": "3"}
    assert len(server.requests) == 2
    with pytest.raises(ConfigurationError, match="tool names"):
        StopAtTools()


def test_a_forced_tool_choice_is_reset_after_a_tool_ran(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.tool_call("add", {"a": 1, "b": 2}), Reply.text("3"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT,
        agent_provider=_provider(server, tool_choice="required"), tools=[add],
    )  # fmt: skip
    assert out.final_text == "3"
    assert [r.body.get("tool_choice") for r in server.requests] == ["required", "auto"]


def test_without_the_reset_a_forced_choice_stays(server: FakeOpenAIServer) -> None:
    server.enqueue(*[Reply.tool_call("add", {"a": 1, "b": 2})] * 3)
    out = run_session_loop(
        Session.from_user_message("go"), AGENT,
        agent_provider=_provider(server, tool_choice="required"), tools=[add],
        reset_tool_choice=False, limits=Limits(max_steps=3),
    )  # fmt: skip
    assert out.stop_reason == "max_steps"
    assert {r.body.get("tool_choice") for r in server.requests} == {"required"}


def test_a_forced_named_function_is_reset_too(server: FakeOpenAIServer) -> None:
    forced = {"type": "function", "function": {"name": "add"}}
    server.enqueue(Reply.tool_call("add", {"a": 2, "b": 2}), Reply.text("4"))
    out = run_session_loop(
        Session.from_user_message("go"), AGENT,
        agent_provider=_provider(server, tool_choice=forced), tools=[add],
    )  # fmt: skip
    assert out.final_text == "4"
    assert [r.body.get("tool_choice") for r in server.requests] == [forced, "auto"]


def test_an_async_on_error_function_is_refused_at_configuration() -> None:
    async def explain(error: BaseException) -> str:
        return "never awaited"

    with pytest.raises(ConfigurationError, match="on_error must be a plain"):
        tool(on_error=explain)(add.fn)  # type: ignore[arg-type]


@pytest.mark.parametrize("returned", [None, {"why": "quota"}])
def test_an_on_error_function_returning_no_str_keeps_the_default_message(
    server: FakeOpenAIServer, returned: Any
) -> None:
    message = _failure_seen(server, lambda error: returned)
    assert "ValueError: original" in message
    assert f"returned {type(returned).__name__}, not the str message" in message
