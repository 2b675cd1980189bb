"""Tool guardrails that stop a pass leave a transcript the conversation can continue from: a
tripped output is withheld, every call of a tripped input round gets its result row; checks of
one round run concurrently; and a check that outlives the pass deadline never counts as passed
(through the fake server, or a scripted executor where only the deadline matters)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.loop import Limits, ToolGuardrail, ToolGuardrailInput, Tripwire
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.scripted import ScriptedExecutor, tool_call
from treadle.tools import tool

#: Seconds a test waits for what must happen at once (only a hang would reach it).
HANG_GUARD = 60.0

ran: list[str] = []


@tool
def fetch(card: str) -> str:
    """Fetch a card.

    Args:
        card: which card
    """
    ran.append(card)
    return f"SECRET-CARD-{card}"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    ran.clear()
    with FakeOpenAIServer(script="echo") as srv:
        yield srv


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test")


def _last_messages(server: FakeOpenAIServer) -> list[dict[str, Any]]:
    bodies = [r.body for r in server.requests if r.path.endswith("/chat/completions")]
    messages: list[dict[str, Any]] = bodies[-1]["messages"]
    return messages


def test_a_tripped_tool_output_is_withheld_from_the_transcript(server: FakeOpenAIServer) -> None:
    def pii(data: ToolGuardrailInput) -> Tripwire | None:
        return (
            Tripwire("card number", "pii", "tool_output")
            if "SECRET" in (data.content or "")
            else None
        )

    agent = Agent(
        "a",
        "Cards.",
        provider=_provider(server),
        tools=[fetch],
        guardrails=[ToolGuardrail(pii, "tool_output")],
    )
    server.enqueue(Reply.tool_call("fetch", {"card": "4111"}))
    out = agent("show my card")
    assert out.stop_reason == "blocked" and out.tripwire.guardrail == "pii"
    assert ran == ["4111"]
    [row] = [r for r in out.rows if r.kind == "tool_result"]
    result = json.loads(row.payload["content"])
    assert result["error_kind"] == "guardrail_tripped" and "withheld" in result["message"]
    assert not any("SECRET" in str(r.payload) for r in out.rows)
    # continuing: the model never sees the result the guardrail tripped on
    server.enqueue(Reply.text("sorry"))
    again = agent(out.add_user_message("and now?"))
    assert again.final_text == "sorry"
    assert "SECRET" not in json.dumps(_last_messages(server))


def test_a_tripped_tool_input_round_answers_every_call(server: FakeOpenAIServer) -> None:
    def screen(data: ToolGuardrailInput) -> Tripwire | str | None:
        card = json.loads(data.call.arguments)["card"]
        if card == "stolen":
            return Tripwire("stolen card", "fraud", "tool_input")
        return "that card is expired" if card == "old" else None

    agent = Agent(
        "a",
        "Cards.",
        provider=_provider(server),
        tools=[fetch],
        guardrails=[ToolGuardrail(screen, "tool_input", name="fraud")],
    )
    server.enqueue(
        Reply.tool_calls_of(
            [("fetch", {"card": "old"}), ("fetch", {"card": "stolen"}), ("fetch", {"card": "ok"})]
        )
    )
    out = agent("fetch them")
    assert out.stop_reason == "blocked" and out.tripwire.reason == "stolen card"
    assert ran == []  # no call of the round ran
    [assistant] = [r for r in out.rows if r.kind == "assistant"]
    results = {
        r.payload["tool_call_id"]: json.loads(r.payload["content"])
        for r in out.rows
        if r.kind == "tool_result"
    }
    old, stolen, fine = (results[c.id] for c in assistant.calls)
    assert old["error_kind"] == "guardrail_rejected" and "expired" in old["message"]
    assert stolen["error_kind"] == "guardrail_tripped" and "'fraud'" in stolen["message"]
    assert fine["error_kind"] == "not_run" and "'fraud'" in fine["message"]
    # continuing: each tool call of the assistant message has its tool message
    server.enqueue(Reply.text("ok"))
    agent(out.add_user_message("and now?")).synchronize(HANG_GUARD)
    sent = _last_messages(server)
    asked = [c["id"] for m in sent if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    answered = [m["tool_call_id"] for m in sent if m["role"] == "tool"]
    assert asked == answered == [c.id for c in assistant.calls]


def test_the_input_checks_of_one_round_run_concurrently(server: FakeOpenAIServer) -> None:
    # The first call's check waits for the second call's check: screened one after the other,
    # it would wait until its timeout and fail the pass.
    second_started = asyncio.Event()

    async def wait_for_the_other(data: ToolGuardrailInput) -> None:
        if json.loads(data.call.arguments)["card"] == "1":
            await second_started.wait()
        else:
            second_started.set()

    agent = Agent(
        "a",
        "Cards.",
        provider=_provider(server),
        tools=[fetch],
        guardrails=[ToolGuardrail(wait_for_the_other, "tool_input", timeout=HANG_GUARD)],
    )
    server.enqueue(
        Reply.tool_calls_of([("fetch", {"card": "1"}), ("fetch", {"card": "2"})]),
        Reply.text("done"),
    )
    out = agent("fetch both")
    assert out.final_text == "done" and sorted(ran) == ["1", "2"]
    # results are listed in call order
    assert [r.when for r in out.metadata["guardrail_results"]] == ["tool_input", "tool_input"]


@pytest.mark.parametrize("when", ["tool_input", "tool_output"])
def test_a_check_swallowing_the_deadline_does_not_pass_the_call(when: str) -> None:
    ran.clear()

    async def fail_open(data: ToolGuardrailInput) -> None:
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            return None  # hostile: lets the call through once the deadline cancelled it

    agent = Agent(
        "a",
        "Cards.",
        executor=ScriptedExecutor([tool_call("fetch", {"card": "1"})], default="never"),
        tools=[fetch],
        guardrails=[ToolGuardrail(fail_open, when, timeout=HANG_GUARD)],  # type: ignore[arg-type]
        limits=Limits(deadline_seconds=0.3),
    )
    out = agent("x").synchronize(HANG_GUARD)
    assert out.stop_reason == "deadline"
    result = json.loads(out.rows[-1].payload["content"])
    assert result["error_kind"] == "timeout"
    assert "guardrails ran" in result["message"]  # what happened, not a tool overrunning
    if when == "tool_input":
        assert "not run" in result["message"] and ran == []
    else:
        assert "withheld" in result["message"] and "SECRET" not in str(out.rows[-1].payload)
    assert "guardrail_results" not in out.metadata  # a late verdict is not a pass
