"""The session loop driven by a ScriptedExecutor: row order, tool errors, stops, laziness."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from treadle import BudgetExceededError, ConfigurationError, ProviderError, Session, Usage
from treadle.llm import Provider
from treadle.loop import Limits, arun_session_loop, run_session_loop
from treadle.testing.scripted import ScriptedExecutor, text, tool_call, tool_calls
from treadle.tools import tool

AGENT = Session.from_agent_prompt("You are terse.")


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


@tool
async def shout(word: str) -> dict[str, str]:
    """Upper-case a word."""
    await asyncio.sleep(0)
    return {"word": word.upper()}


@tool
def explode() -> None:
    """Always fails."""
    raise RuntimeError("kaboom")


def _content(row: Any) -> dict[str, Any]:
    return json.loads(row.payload["content"])  # type: ignore[no-any-return]


def test_final_answer_without_tools() -> None:
    user = Session.from_user_message("hi")
    ex = ScriptedExecutor([text("hello", usage={"prompt_tokens": 7, "completion_tokens": 3})])
    out = run_session_loop(user, AGENT, executor=ex)
    assert out.chunk_table.kinds() == ["user", "assistant"]
    assert out.stop_reason == "final_answer"
    assert out.final_text == "hello"
    assert out.usage == Usage(7, 3, 10, 1)
    assert set(out.lineage.parent_ids) == {user.id, AGENT.id}
    # the agent rows were sent first but never copied into the output
    assert [m["role"] for m in ex.requests[0].messages()] == ["system", "user"]


def test_tool_round_row_order_and_contents() -> None:
    ex = ScriptedExecutor(
        [
            tool_calls([("add", {"a": 2, "b": 3}), ("shout", {"word": "hey"})], ids=["c1", "c2"]),
            text("5 and HEY"),
        ]
    )
    out = run_session_loop(Session.from_user_message("go"), AGENT, executor=ex, tools=[add, shout])
    rows = out.rows
    assert [r.kind for r in rows] == [
        "user",
        "assistant",
        "tool_result",
        "tool_result",
        "assistant",
    ]
    assert [r.payload["tool_call_id"] for r in rows[2:4]] == ["c1", "c2"]
    assert [r.payload["name"] for r in rows[2:4]] == ["add", "shout"]
    assert _content(rows[2]) == {"ok": True, "result": 5}
    assert _content(rows[3]) == {"ok": True, "word": "HEY"}
    # the second request carried the tool results and the tool schemas
    second = ex.requests[1].messages()
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool", "tool"]
    names = [s["function"]["name"] for s in ex.requests[1].tool_schemas()]
    assert names == ["add", "shout"]
    assert out.usage.requests == 2


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (tool_call("nope", {}), "unknown_tool"),
        (tool_call("add", "{not json"), "invalid_tool_arguments"),
        (tool_call("add", "[1, 2]"), "invalid_tool_arguments"),
        (tool_call("add", {"a": "x", "b": 1}), "invalid_tool_arguments"),
        (tool_call("explode", {}), "tool_execution_exception"),
    ],
)
def test_tool_errors_go_back_to_the_model(call: dict[str, Any], kind: str) -> None:
    ex = ScriptedExecutor([call, text("recovered")])
    out = run_session_loop(Session.from_user_message("x"), AGENT, executor=ex, tools=[add, explode])
    result = _content(out.rows[2])
    assert result["ok"] is False
    assert result["error_kind"] == kind
    assert result["message"]
    assert out.stop_reason == "final_answer"


def test_empty_arguments_mean_an_empty_object() -> None:
    ex = ScriptedExecutor([tool_call("explode", ""), text("ok")])
    out = run_session_loop(Session.from_user_message("x"), AGENT, executor=ex, tools=[explode])
    assert _content(out.rows[2])["error_kind"] == "tool_execution_exception"
    assert "kaboom" in _content(out.rows[2])["message"]


def test_max_steps_keeps_the_transcript_and_resumes() -> None:
    ex = ScriptedExecutor(default=tool_call("add", {"a": 1, "b": 1}))
    out = run_session_loop(
        Session.from_user_message("loop"), AGENT, executor=ex, tools=[add], max_tool_rounds=3
    )
    assert out.stop_reason == "max_steps"
    assert out.chunk_table.kinds() == ["user"] + ["assistant", "tool_result"] * 3
    resumed = run_session_loop(out, AGENT, executor=ScriptedExecutor([text("done")]), tools=[add])
    assert resumed.stop_reason == "final_answer"
    assert len(resumed.rows) == len(out.rows) + 1


def test_budget_callback_fires_once_and_can_stop() -> None:
    seen: list[int] = []

    def over(session: Session, usage: Usage) -> None:
        seen.append(usage.total_tokens)
        raise BudgetExceededError("too expensive")

    provider = Provider(
        model="m", base_url="http://127.0.0.1:9/v1", budget_total_tokens=25, on_budget_exceeded=over
    )
    ex = ScriptedExecutor(default=tool_call("add", {"a": 1, "b": 2}))
    out = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ex, agent_provider=provider, tools=[add]
    )
    assert out.stop_reason == "budget"
    assert seen == [30]  # 15 tokens per reply: crossed on the second completion, fired once
    assert out.rows[-1].kind == "tool_result"  # the round's tools ran: no orphaned tool call


def test_budget_without_callback_warns_once_and_runs_on(caplog: pytest.LogCaptureFixture) -> None:
    # The soft budget (OpenRath's behaviour): one warning at the first crossing, the pass goes on.
    provider = Provider(model="m", base_url="http://127.0.0.1:9/v1", budget_total_tokens=1)
    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 2})] * 3 + [text("3")])
    with caplog.at_level("WARNING", logger="treadle"):
        out = run_session_loop(
            Session.from_user_message("x"), AGENT, executor=ex, agent_provider=provider, tools=[add]
        )
        assert out.stop_reason == "final_answer" and out.final_text == "3"
    assert len(ex.requests) == 4
    warnings = [r for r in caplog.records if "budget_total_tokens=1" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "used 15 tokens" in warnings[0].getMessage()
    assert "budget_message" not in out.metadata


def test_limits_max_total_tokens_is_the_hard_stop() -> None:
    ex = ScriptedExecutor(default=tool_call("add", {"a": 1, "b": 2}))
    out = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ex, tools=[add],
        limits=Limits(max_total_tokens=20),
    )  # fmt: skip
    assert out.stop_reason == "budget"
    assert len(ex.requests) == 2  # 15 tokens a reply: stopped once 30 >= 20, before the third
    assert out.rows[-1].kind == "tool_result"  # the round's tools ran: no orphaned tool call


def test_budget_callback_that_returns_lets_the_pass_run_on() -> None:
    seen: list[int] = []
    provider = Provider(
        model="m",
        base_url="http://127.0.0.1:9/v1",
        budget_total_tokens=1,
        on_budget_exceeded=lambda session, usage: seen.append(usage.total_tokens),
    )
    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 2}), text("3")])
    out = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ex, agent_provider=provider, tools=[add]
    )
    assert out.stop_reason == "final_answer" and seen == [15]


def test_configuration_errors_raise_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    user = Session.from_user_message("x")
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    with pytest.raises(ConfigurationError, match="TREADLE_MODEL"):
        run_session_loop(user, AGENT, agent_provider=Provider(base_url="http://127.0.0.1:1/v1"))
    with pytest.raises(ConfigurationError, match="agent_provider"):
        run_session_loop(user, AGENT)
    with pytest.raises(ConfigurationError, match="on_event"):
        run_session_loop(user, AGENT, executor=ScriptedExecutor(), on_event=print)
    with pytest.raises(ConfigurationError, match="max_tool_rounds"):
        run_session_loop(user, AGENT, executor=ScriptedExecutor(), max_tool_rounds=0)
    with pytest.raises(ConfigurationError, match="user_session"):
        run_session_loop("hi", AGENT, executor=ScriptedExecutor())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="acomplete"):
        run_session_loop(user, AGENT, executor=object())


def test_failed_pass_reraises_on_every_read() -> None:
    boom = ProviderError("server on fire", status_code=500)
    out = run_session_loop(Session.from_user_message("x"), AGENT, executor=ScriptedExecutor([boom]))
    for _ in range(2):
        with pytest.raises(ProviderError, match="server on fire"):
            _ = out.chunk_table
    with pytest.raises(ProviderError):
        _ = out.stop_reason


def test_pending_input_chains_without_blocking_the_caller() -> None:
    gate = threading.Event()

    async def gated(request: Any) -> Any:
        while not gate.is_set():
            await asyncio.sleep(0.005)
        return text("first")

    class Gated(ScriptedExecutor):
        async def acomplete(self, request: Any) -> Any:
            await gated(request)
            return await super().acomplete(request)

    first = run_session_loop(Session.from_user_message("1"), AGENT, executor=Gated(["first"]))
    second = run_session_loop(
        first.add_user_message("2") if first.done() else first,
        AGENT,
        executor=ScriptedExecutor(["second"]),
    )
    assert not second.done()  # returned at once although its input is still running
    gate.set()
    assert [r.content for r in second.rows] == ["1", "first", "second"]


def test_second_pass_sees_first_pass_tool_results() -> None:
    ex1 = ScriptedExecutor([tool_call("add", {"a": 20, "b": 22}), text("42")])
    first = run_session_loop(Session.from_user_message("add"), AGENT, executor=ex1, tools=[add])
    ex2 = ScriptedExecutor(["it was 42"])
    second = run_session_loop(first.add_user_message("what was it?"), AGENT, executor=ex2)
    second.synchronize()
    sent = ex2.requests[0].messages()
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert json.loads(sent[3]["content"])["result"] == 42
    assert second.final_text == "it was 42"


def test_thousand_lazy_passes_overlap() -> None:
    outs = [
        run_session_loop(
            Session.from_user_message(str(i)),
            AGENT,
            executor=ScriptedExecutor([tool_call("add", {"a": i, "b": 1}), text(str(i + 1))]),
            tools=[add],
        )
        for i in range(1000)
    ]
    for i, out in enumerate(outs):
        assert out.final_text == str(i + 1)
        assert _content(out.rows[2])["result"] == i + 1


async def test_await_from_async_code_and_arun() -> None:
    out = await run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ScriptedExecutor(["lazy"])
    )
    assert out.final_text == "lazy"
    direct = await arun_session_loop(
        Session.from_user_message("x"), AGENT, executor=ScriptedExecutor(["direct"])
    )
    assert direct.final_text == "direct"
    assert direct.stop_reason == "final_answer"


def test_sync_executor_runs_off_the_loop() -> None:
    class Sync:
        def __init__(self) -> None:
            self.threads: list[str] = []

        def complete(self, request: Any) -> dict[str, Any]:
            self.threads.append(threading.current_thread().name)
            return text("sync")

    ex = Sync()
    out = run_session_loop(Session.from_user_message("x"), AGENT, executor=ex)
    assert out.final_text == "sync"
    assert ex.threads and ex.threads[0] != "treadle-runtime"


def test_custom_dispatch_tool() -> None:
    class Dispatching(ScriptedExecutor):
        async def adispatch_tool(self, session: Session, tool: Any, arguments: Any) -> Any:
            return {"dispatched": tool.name, "args": arguments}

    ex = Dispatching([tool_call("add", {"a": 1, "b": 2}), tool_call("nope", {}), text("ok")])
    out = run_session_loop(Session.from_user_message("x"), AGENT, executor=ex, tools=[add])
    assert _content(out.rows[2]) == {"ok": True, "dispatched": "add", "args": {"a": 1, "b": 2}}
    assert _content(out.rows[4])["error_kind"] == "unknown_tool"
