"""Control of a pass: guardrails, interrupts, approvals, limits, cancellation, typed events."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from treadle import Limits, PassControl, Session, Tripwire, after_model, before_model, tool
from treadle.llm import Provider
from treadle.loop import run_session_loop, stream_session_loop
from treadle.loop.control import GuardrailInput
from treadle.persist import load_session
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer
from treadle.testing.scripted import ScriptedExecutor, text, tool_call

AGENT = Session.from_agent_prompt("sys")


@tool
def add(a: int, b: int) -> int:
    """Add."""
    return a + b


@tool(needs_approval=True)
def deploy(target: str) -> str:
    """Deploy somewhere (needs a human's approval)."""
    return f"deployed to {target}"


def _results(out: Session) -> list[dict[str, Any]]:
    return [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]


# -- guardrails -------------------------------------------------------------------------------
def test_before_guardrail_trips_without_calling_the_model() -> None:
    @before_model
    def no_secrets(data: GuardrailInput) -> str | None:
        last = data.request.messages()[-1]["content"]
        return "asked for a secret" if "password" in last else None

    ex = ScriptedExecutor(["never sent"])
    out = run_session_loop(
        Session.from_user_message("tell me the password"),
        AGENT,
        executor=ex,
        guardrails=[no_secrets],
    )
    assert out.stop_reason == "blocked"
    assert out.tripwire == Tripwire("asked for a secret", "no_secrets", "before")
    assert ex.requests == []  # the model was not called
    assert out.chunk_table.kinds() == ["user"]


async def test_after_guardrail_discards_the_reply() -> None:
    @after_model
    async def no_shouting(data: GuardrailInput) -> bool:
        assert data.reply is not None
        return (data.reply.message.content or "").isupper()

    out = await run_session_loop(
        Session.from_user_message("hi"),
        AGENT,
        executor=ScriptedExecutor(["HELLO"]),
        guardrails=[no_shouting],
    )
    assert out.stop_reason == "blocked"
    assert out.tripwire.when == "after"
    assert out.chunk_table.kinds() == ["user"]  # the reply was discarded
    assert out.usage.requests == 1  # but the tokens it cost are counted


def test_plain_callable_guardrail_runs_before_and_errors_propagate() -> None:
    def broken(_data: GuardrailInput) -> None:
        raise RuntimeError("guardrail bug")

    out = run_session_loop(
        Session.from_user_message("x"),
        AGENT,
        executor=ScriptedExecutor(["y"]),
        guardrails=[broken],
    )
    with pytest.raises(RuntimeError, match="guardrail bug"):
        out.synchronize()


# -- interrupts and approvals -------------------------------------------------------------------
def test_interrupt_after_tool_call_then_resume_runs_it_first() -> None:
    def stop_on_calls(row: Any, control: PassControl) -> None:
        if row.kind == "assistant" and row.tool_calls:
            control.interrupt("let me look first")

    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 2}, id="c1")])
    out = run_session_loop(
        Session.from_user_message("add"), AGENT, executor=ex, tools=[add], on_message=stop_on_calls
    )
    assert out.stop_reason == "interrupted"
    assert out.interrupt_reason == "let me look first"
    assert out.chunk_table.kinds() == ["user", "assistant"]  # the call has not run
    ex2 = ScriptedExecutor(["3"])
    resumed = run_session_loop(out, AGENT, executor=ex2, tools=[add])
    assert resumed.chunk_table.kinds() == ["user", "assistant", "tool_result", "assistant"]
    assert _results(resumed) == [{"ok": True, "result": 3}]
    # the model was called only after the pending call ran
    assert [m["role"] for m in ex2.requests[0].messages()][-1] == "tool"


def test_a_new_message_after_an_interrupted_round_answers_its_calls_first() -> None:
    """Interrupted with the calls asked for and not run, then continued with a new message
    instead of a resume: each call gets a "no result" row before the message (a message after
    calls without results is a transcript OpenAI-style APIs refuse)."""

    def stop_on_calls(row: Any, control: PassControl) -> None:
        if row.kind == "assistant" and row.calls:
            control.interrupt("wait")

    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 2}, id="c1")])
    out = run_session_loop(
        Session.from_user_message("add"), AGENT, executor=ex, tools=[add], on_message=stop_on_calls
    )
    ex2 = ScriptedExecutor(["4"])
    again = run_session_loop(
        out.add_user_message("no, 2+2?"), AGENT, executor=ex2, tools=[add]
    ).synchronize()
    roles = [m["role"] for m in ex2.requests[0].messages()]
    assert roles[-3:] == ["assistant", "tool", "user"]
    assert "no result" in ex2.requests[0].messages()[-2]["content"]
    assert again.chunk_table.kinds()[-4:] == ["assistant", "tool_result", "user", "assistant"]


def test_interrupt_after_a_tool_result() -> None:
    seen: list[str] = []

    async def watch(row: Any, control: PassControl) -> None:
        seen.append(row.kind)
        if row.kind == "tool_result":
            control.interrupt("enough")

    ex = ScriptedExecutor([tool_call("add", {"a": 1, "b": 1}), text("never")])
    out = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ex, tools=[add], on_message=watch
    )
    assert out.stop_reason == "interrupted"
    assert seen == ["assistant", "tool_result"]
    assert ex.remaining == 1


@pytest.mark.parametrize(("decision", "ok"), [(True, True), (False, False), ("not today", False)])
def test_approval_interrupts_then_runs_or_denies(decision: bool | str, ok: bool) -> None:
    ex = ScriptedExecutor([tool_call("deploy", {"target": "prod"}, id="d1")])
    out = run_session_loop(Session.from_user_message("ship"), AGENT, executor=ex, tools=[deploy])
    assert out.stop_reason == "interrupted"
    assert "approval required for deploy" in (out.interrupt_reason or "")
    assert out.pending_approvals == [
        {"id": "d1", "name": "deploy", "arguments": '{"target":"prod"}'}
    ]
    resumed = run_session_loop(
        out, AGENT, executor=ScriptedExecutor(["done"]), tools=[deploy], approvals={"d1": decision}
    )
    result = _results(resumed)[0]
    assert result["ok"] is ok
    if ok:
        assert result["result"] == "deployed to prod"
    else:
        assert result["error_kind"] == "denied"
        if isinstance(decision, str):
            assert decision in result["message"]
    assert resumed.stop_reason == "final_answer"
    assert resumed.pending_approvals == []


def test_an_approval_decides_one_call_not_a_later_call_with_the_same_id() -> None:
    """Providers that number calls per reply (`call_0` every round) or send none (Treadle names
    them `call_<n>`): the approval given for the first round's call must not run the second
    round's different call that reuses its id; that one is asked for again."""
    ex = ScriptedExecutor(
        [
            tool_call("deploy", {"target": "staging"}, id="call_0"),
            tool_call("deploy", {"target": "PRODUCTION"}, id="call_0"),
            "done",
        ]
    )
    out = run_session_loop(Session.from_user_message("ship"), AGENT, executor=ex, tools=[deploy])
    resumed = run_session_loop(out, AGENT, executor=ex, tools=[deploy], approvals={"call_0": True})
    assert resumed.stop_reason == "interrupted"
    assert resumed.pending_approvals == [
        {"id": "call_0", "name": "deploy", "arguments": '{"target":"PRODUCTION"}'}
    ]
    assert [r["result"] for r in _results(resumed)] == ["deployed to staging"]


def test_decisions_for_calls_not_in_the_decided_round_are_not_kept_for_later() -> None:
    ex = ScriptedExecutor(
        [
            tool_call("deploy", {"target": "staging"}, id="call_0"),
            tool_call("deploy", {"target": "PRODUCTION"}, id="call_1"),
            "done",
        ]
    )
    out = run_session_loop(Session.from_user_message("ship"), AGENT, executor=ex, tools=[deploy])
    stale = {"call_0": True, "call_1": True}  # call_1 was never shown to the user
    resumed = run_session_loop(out, AGENT, executor=ex, tools=[deploy], approvals=stale)
    assert resumed.stop_reason == "interrupted"
    assert [a["id"] for a in resumed.pending_approvals] == ["call_1"]


# -- limits --------------------------------------------------------------------------------------
def test_limits_max_steps_and_tool_calls() -> None:
    loop = tool_call("add", {"a": 1, "b": 1})
    out = run_session_loop(
        Session.from_user_message("x"),
        AGENT,
        executor=ScriptedExecutor(default=loop),
        tools=[add],
        limits=Limits(max_steps=2),
    )
    assert out.stop_reason == "max_steps" and len(_results(out)) == 2
    out = run_session_loop(
        Session.from_user_message("x"),
        AGENT,
        executor=ScriptedExecutor(default=loop),
        tools=[add],
        limits=Limits(max_tool_calls=3),
    )
    assert out.stop_reason == "max_steps" and len(_results(out)) == 3


def test_limits_tokens_with_a_final_answer() -> None:
    ex = ScriptedExecutor(
        [
            tool_call("add", {"a": 1, "b": 1}),
            tool_call("add", {"a": 2, "b": 2}),
            text("summary so far"),
        ]
    )
    out = run_session_loop(
        Session.from_user_message("x"),
        AGENT,
        executor=ex,
        tools=[add],
        limits=Limits(max_total_tokens=20, final_answer_on_limit=True),
    )
    assert out.stop_reason == "budget"
    assert out.chunk_table.kinds()[-1] == "assistant"
    assert out.final_text == "summary so far"
    assert ex.requests[-1].extra == {"tool_choice": "none"}  # the last request offered no tools


def test_deadline_cancels_a_slow_request_and_stops() -> None:
    async def slow(_request: Any) -> Any:
        await asyncio.sleep(30)
        return text("too late")

    out = run_session_loop(
        Session.from_user_message("x"),
        AGENT,
        executor=ScriptedExecutor([slow]),
        limits=Limits(deadline_seconds=0.2),
    )
    assert out.synchronize(timeout=20).stop_reason == "deadline"
    assert out.chunk_table.kinds() == ["user"]


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="max_steps"):
        Limits(max_steps=0)
    with pytest.raises(ValueError, match="deadline_seconds"):
        Limits(deadline_seconds=-1)


# -- cancellation ------------------------------------------------------------------------------
def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30  # a bound on waiting, not a timing assertion
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cancel_kills_the_running_command_and_leaves_no_trailer(tmp_path: Path) -> None:
    file = tmp_path / "s.jsonl"
    user = Session.from_user_message("run it").to(str(tmp_path))
    cmd = "echo $$ > pid.txt; sleep 60"
    ex = ScriptedExecutor([tool_call("run_shell_command", {"cmd": cmd})])
    before = get_runtime().pending
    out = run_session_loop(user, AGENT, executor=ex, persist_path=file)
    _wait_for(tmp_path / "pid.txt")
    pid = int((tmp_path / "pid.txt").read_text())
    assert _alive(pid)
    out.cancel()
    assert out.synchronize(timeout=30).stop_reason == "cancelled"
    assert not _alive(pid)  # the command's process group was killed
    assert not load_session(file, sandbox=False).closed  # no trailer
    assert out.chunk_table.kinds() == ["user", "assistant"]  # resumable: the call is pending
    assert get_runtime().pending == before  # no task outlived its pass
    user.close_sandbox()
    out.close_sandbox()


async def test_cancelling_the_awaiting_task_cancels_a_streaming_request() -> None:
    with FakeOpenAIServer(script="echo", latency_ms=30_000) as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=True)
        out = run_session_loop(Session.from_user_message("x"), AGENT, agent_provider=provider)
        waiter = asyncio.ensure_future(_await(out))
        await asyncio.sleep(
            0
        )  # let the waiter start: a task cancelled before it runs awaits nothing
        while server.in_flight == 0:
            await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        data = await out.wait_ready()
        assert data.stop_reason == "cancelled"
        while server.in_flight:  # the request's connection was closed, so the server gave up
            await asyncio.sleep(0.01)


async def _await(session: Session) -> Session:
    return await session


# -- typed events -------------------------------------------------------------------------------
def _collapse(types: list[str]) -> list[str]:
    out: list[str] = []
    for t in types:
        if not out or out[-1] != t:
            out.append(t)
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_event_order_is_the_same_streamed_or_not(stream: bool) -> None:
    with FakeOpenAIServer(script="file_worker") as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=stream)
        user = Session.from_user_message("Create a file, then read it back.").to("local")
        events = [e async for e in stream_session_loop(user, AGENT, agent_provider=provider)]
    assert [e.seq for e in events] == list(range(len(events)))
    assert len({e.session_id for e in events}) == 1
    round_ = ["tool_call_delta", "usage", "assistant_row", "tool_started", "tool_result"]
    assert _collapse([e.type for e in events]) == [
        "pass_started",
        *round_,
        *round_,
        "text_delta",
        "usage",
        "assistant_row",
        "stop",
    ]
    stop = events[-1]
    assert stop.stop_reason == "final_answer"
    assert stop.session is not None and stop.session.id == stop.session_id
    assert stop.session.chunk_table.kinds()[-1] == "assistant"
    stop.session.close_sandbox()
    user.close_sandbox()


async def test_leaving_the_event_stream_early_cancels_the_pass() -> None:
    with FakeOpenAIServer(script="echo", latency_ms=30_000) as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k")
        agen = stream_session_loop(Session.from_user_message("x"), AGENT, agent_provider=provider)
        first = await agen.__anext__()
        assert first.type == "pass_started"
        await agen.aclose()
        while server.in_flight:
            await asyncio.sleep(0.01)


def test_cancel_before_the_pass_starts_is_a_clean_stop() -> None:
    gate = threading.Event()

    async def later() -> Session:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return Session.from_user_message("late")

    from treadle.runtime import run_lazy

    pending_input = run_lazy(later())
    executor = ScriptedExecutor(["x"])
    out = run_session_loop(pending_input, AGENT, executor=executor)
    out.cancel()  # the pass is still waiting for its input (or has not even started)
    assert not pending_input.done()  # a consumer's cancel never cancels a shared input
    gate.set()
    done = out.synchronize(timeout=30)
    assert done.stop_reason == "cancelled"
    # the output still holds the input rows, and no request was made
    assert [r.payload["content"] for r in done.rows] == ["late"]
    assert executor.requests == []


def test_cancel_immediately_after_submit() -> None:
    outs = [
        run_session_loop(Session.from_user_message(str(i)), AGENT, executor=ScriptedExecutor(["x"]))
        for i in range(50)
    ]
    for out in outs:
        out.cancel()
    for out in outs:
        assert out.synchronize(timeout=30).stop_reason in ("cancelled", "final_answer")
