"""Guardrails through the fake server: input guardrails racing the first model call (cancelled
and not charged when they trip), guardrails concurrent with each other, every result on the
session, output guardrails, and tool input/output guardrails."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from treadle import ConfigurationError, Session
from treadle.agents import Agent
from treadle.llm import Provider
from treadle.loop import (
    Guardrail,
    GuardrailInput,
    GuardrailResult,
    ToolGuardrail,
    ToolGuardrailInput,
    Tripwire,
    run_session_loop,
)
from treadle.testing import FakeOpenAIServer, Reply
from treadle.tools import tool

HANG_GUARD = 120.0


@tool
def transfer_money(amount: int) -> dict[str, Any]:
    """Move money.

    Args:
        amount: how much
    """
    return {"moved": amount, "account": "ACC-12345"}


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test")


def test_input_guardrail_trips_while_the_model_call_runs(server: FakeOpenAIServer) -> None:
    arrived = threading.Event()

    def slow_reply(request: dict[str, Any]) -> Reply:
        arrived.set()  # the model call is out on the wire before the guardrail decides
        # an hour: reading the output within HANG_GUARD proves the call was cancelled
        return Reply.text("too late").with_latency(3_600_000)

    server.script = slow_reply

    async def no_homework(data: GuardrailInput) -> str | None:
        await asyncio.to_thread(arrived.wait, HANG_GUARD)
        return "homework requests are refused"

    agent = Agent(
        "tutor",
        "Help.",
        provider=_provider(server),
        guardrails=[Guardrail(no_homework, "input")],
    )
    out = agent("do my homework")
    out.synchronize(HANG_GUARD)
    assert arrived.is_set()
    assert out.stop_reason == "blocked"
    assert out.tripwire.when == "input"
    assert out.tripwire.reason == "homework requests are refused"
    # the call was cancelled: nothing charged, no assistant row
    assert out.usage.requests == 0
    assert out.chunk_table.kinds() == ["user"]
    assert server.request_count == 1
    [result] = out.metadata["guardrail_results"]
    assert isinstance(result, GuardrailResult)
    assert result.tripped and result.guardrail == "no_homework"


def test_guardrails_run_concurrently_and_every_result_is_kept(server: FakeOpenAIServer) -> None:
    a_ran, b_ran = asyncio.Event(), asyncio.Event()

    async def first(data: GuardrailInput) -> None:
        a_ran.set()
        await asyncio.wait_for(b_ran.wait(), HANG_GUARD)  # only ends if `second` runs meanwhile

    async def second(data: GuardrailInput) -> None:
        b_ran.set()
        await asyncio.wait_for(a_ran.wait(), HANG_GUARD)

    def polite(data: GuardrailInput) -> None:
        return None

    agent = Agent(
        "helper",
        "Help.",
        provider=_provider(server),
        guardrails=[
            Guardrail(first, "input", parallel=False),
            Guardrail(second, "input", parallel=False),
            Guardrail(polite, "output"),
        ],
    )
    server.enqueue(Reply.text("Happy to help."))
    out = agent("hello")
    assert out.final_text == "Happy to help."
    results = out.metadata["guardrail_results"]
    assert [(r.guardrail, r.when, r.tripped) for r in results] == [
        ("first", "input", False),
        ("second", "input", False),
        ("polite", "output", False),
    ]


def test_input_guardrails_run_once_per_run_and_output_guard_trips(
    server: FakeOpenAIServer,
) -> None:
    seen: list[int] = []

    def count_input(data: GuardrailInput) -> None:
        seen.append(len(data.session.rows))

    def no_secrets(data: GuardrailInput) -> Tripwire | None:
        assert data.reply is not None
        if "ACC-" in (data.reply.message.content or ""):
            return Tripwire("account number in the answer", "no_secrets", "output")
        return None

    agent = Agent(
        "banker",
        "Bank.",
        provider=_provider(server),
        tools=[transfer_money],
        guardrails=[Guardrail(count_input, "input"), Guardrail(no_secrets, "output")],
    )
    server.enqueue(
        Reply.tool_call("transfer_money", {"amount": 5}),  # output guard skips tool-call replies
        Reply.text("Moved 5 from ACC-12345."),
    )
    out = agent("move 5")
    assert out.stop_reason == "blocked"
    assert out.tripwire.guardrail == "no_secrets"
    assert seen == [1]  # the first request only
    assert out.chunk_table.kinds() == ["user", "assistant", "tool_result"]  # reply discarded


def test_tool_guardrails_reject_rewrite_and_trip(server: FakeOpenAIServer) -> None:
    def limit(data: ToolGuardrailInput) -> str | None:
        amount = json.loads(data.call.arguments)["amount"]
        return f"amount {amount} is over the limit of 100" if amount > 100 else None

    def redact(data: ToolGuardrailInput) -> str | None:
        return "the result held an account number" if "ACC-" in (data.content or "") else None

    server.enqueue(
        Reply.tool_calls_of(
            [("transfer_money", {"amount": 500}), ("transfer_money", {"amount": 7})]
        ),
        Reply.text("done"),
    )
    ran: list[int] = []

    @tool
    def audited(amount: int) -> int:
        """Audited move.

        Args:
            amount: how much
        """
        ran.append(amount)
        return amount

    out = run_session_loop(
        Session.from_user_message("move"),
        Session.from_agent_prompt("Bank."),
        agent_provider=_provider(server),
        tools=[transfer_money, audited],
        guardrails=[
            ToolGuardrail(limit, "tool_input", tools={"transfer_money"}),
            ToolGuardrail(redact, "tool_output"),
        ],
    )
    assert out.final_text == "done"
    first, second = (json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result")
    assert first["error_kind"] == "guardrail_rejected"
    assert "over the limit" in first["message"]
    assert second["error_kind"] == "guardrail_rejected"  # the output guard hid the account
    kinds = [(r.guardrail, r.when, r.tripped) for r in out.metadata["guardrail_results"]]
    assert ("limit", "tool_input", True) in kinds and ("limit", "tool_input", False) in kinds

    def stop_all(data: ToolGuardrailInput) -> Tripwire:
        return Tripwire("no tools today", "stop_all", "tool_input")

    server.enqueue(Reply.tool_call("audited", {"amount": 1}), Reply.text("never"))
    blocked = run_session_loop(
        Session.from_user_message("move"),
        Session.from_agent_prompt("Bank."),
        agent_provider=_provider(server),
        tools=[audited],
        guardrails=[ToolGuardrail(stop_all)],
    )
    assert blocked.stop_reason == "blocked"
    assert blocked.tripwire.when == "tool_input"
    assert ran == []  # the call never ran


def test_guardrails_given_as_a_generator_all_apply(server: FakeOpenAIServer) -> None:
    # A one-shot iterable is read once: the pass and tool guardrails both come from that read.
    def refuse_all(data: ToolGuardrailInput) -> str:
        return "no tools from a generator"

    seen: list[str] = []

    def look(data: GuardrailInput) -> None:
        seen.append("before")

    def guards() -> Any:
        yield look
        yield ToolGuardrail(refuse_all, "tool_input")

    server.enqueue(Reply.tool_call("transfer_money", {"amount": 1}), Reply.text("done"))
    out = run_session_loop(
        Session.from_user_message("move"),
        Session.from_agent_prompt("Bank."),
        agent_provider=_provider(server),
        tools=[transfer_money],
        guardrails=guards(),
    )
    assert out.final_text == "done"
    [result] = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert result["error_kind"] == "guardrail_rejected"
    assert seen  # and the plain one ran before the model
    ran = {(r.guardrail, r.when) for r in out.metadata["guardrail_results"]}
    assert ("refuse_all", "tool_input") in ran


def test_guardrail_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="'input' or 'output'"):
        Guardrail(lambda d: None, "sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="tool_input"):
        ToolGuardrail(lambda d: None, "before")  # type: ignore[arg-type]


def test_a_trip_wins_over_a_failing_first_call() -> None:
    from treadle.testing.scripted import ScriptedExecutor

    def refuse(data: GuardrailInput) -> str:
        return "not today"

    agent = Agent(
        "a", "Help.", executor=ScriptedExecutor([]), guardrails=[Guardrail(refuse, "input")]
    )
    out = agent("hello")  # the scripted model fails at once; the guardrail still decides
    assert out.stop_reason == "blocked"
    assert out.tripwire.reason == "not today"
    with pytest.raises(ConfigurationError, match="ran out of replies"):
        Agent(
            "b",
            "Help.",
            executor=ScriptedExecutor([]),
            guardrails=[Guardrail(lambda d: None, "input")],
        )("hello").synchronize(HANG_GUARD)


def test_a_trip_after_the_first_call_finished_still_counts_its_usage() -> None:
    from treadle.llm import ChatCompletion, CompletionRequest
    from treadle.testing.scripted import ScriptedExecutor, text

    finished = threading.Event()

    class Signalling(ScriptedExecutor):
        async def acomplete(self, request: CompletionRequest) -> ChatCompletion:
            reply = await super().acomplete(request)
            finished.set()  # the reply is back (and billed) before the guardrail decides
            return reply

    async def late_refusal(data: GuardrailInput) -> str:
        await asyncio.to_thread(finished.wait, HANG_GUARD)
        return "refused after all"

    executor = Signalling([text("Hello.", usage={"prompt_tokens": 1000, "completion_tokens": 500})])
    agent = Agent("a", "Help.", executor=executor, guardrails=[Guardrail(late_refusal, "input")])
    out = agent("hi")
    out.synchronize(HANG_GUARD)
    assert finished.is_set()
    assert out.stop_reason == "blocked"
    assert out.chunk_table.kinds() == ["user"]  # the reply itself is dropped
    [entry] = out.metadata["request_usage"]
    # the totals and the entries agree: the finished call is counted in both
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (1000, 500)
    assert (entry.input_tokens, entry.output_tokens) == (1000, 500)


def test_a_hanging_guardrail_fails_its_pass_at_its_timeout_and_stops_at_the_deadline() -> None:
    import anyio

    from treadle.errors import GuardrailError
    from treadle.loop import Limits
    from treadle.testing.scripted import ScriptedExecutor, tool_call

    release = threading.Event()

    async def async_hang(data: GuardrailInput) -> None:
        await anyio.sleep_forever()

    def sync_hang(data: GuardrailInput) -> None:
        release.wait(HANG_GUARD)  # its thread is abandoned at the timeout, released below

    try:
        for check in (async_hang, sync_hang):
            for when in ("input", "before", "output"):
                guard = Guardrail(check, when, timeout=0.2)  # type: ignore[arg-type]
                agent = Agent("h", "t", executor=ScriptedExecutor(default="a"), guardrails=[guard])
                with pytest.raises(GuardrailError, match=f"guardrail {check.__name__} ran over"):
                    agent("x").synchronize(HANG_GUARD)
                # the pass deadline bounds a guardrail whose own timeout is longer
                slow = Guardrail(check, when)  # type: ignore[arg-type]
                bounded = Agent(
                    "d",
                    "t",
                    executor=ScriptedExecutor(default="a"),
                    guardrails=[slow],
                    limits=Limits(deadline_seconds=0.3),
                )
                out = bounded("x")
                assert out.synchronize(HANG_GUARD).stop_reason == "deadline", (check, when)
        tool_guard = ToolGuardrail(lambda d: release.wait(HANG_GUARD), "tool_input", timeout=0.2)
        agent = Agent(
            "t",
            "t",
            executor=ScriptedExecutor([tool_call("transfer_money", {"amount": 1})], default="a"),
            tools=[transfer_money],
            guardrails=[tool_guard],
        )
        with pytest.raises(GuardrailError, match=r"ran over 0\.2 s"):
            agent("x").synchronize(HANG_GUARD)
    finally:
        release.set()
    with pytest.raises(ConfigurationError, match="timeout must be a positive"):
        Guardrail(lambda d: None, timeout=0)
    with pytest.raises(ConfigurationError, match="timeout must be a positive"):
        ToolGuardrail(lambda d: None, timeout="1")  # type: ignore[arg-type]


def test_a_hanging_tool_guardrail_ends_at_the_pass_deadline() -> None:
    import anyio

    from treadle.loop import Limits
    from treadle.testing.scripted import ScriptedExecutor, tool_call

    release = threading.Event()
    ran: list[int] = []

    @tool
    def pay(amount: int) -> dict[str, Any]:
        """Pay.

        Args:
            amount: how much
        """
        ran.append(amount)
        return {"paid": amount}

    async def async_hang(data: ToolGuardrailInput) -> None:
        await anyio.sleep_forever()

    def sync_hang(data: ToolGuardrailInput) -> None:
        release.wait(HANG_GUARD)  # its thread is abandoned at the deadline, released below

    try:
        for check in (async_hang, sync_hang):
            for when in ("tool_input", "tool_output"):
                ran.clear()
                agent = Agent(
                    "d",
                    "t",
                    executor=ScriptedExecutor(
                        [tool_call("pay", {"amount": 1}), tool_call("pay", {"amount": 2})],
                        default="never reached",
                    ),
                    tools=[pay],
                    # its own timeout (60 s) is far longer: the deadline is what ends it
                    guardrails=[ToolGuardrail(check, when)],  # type: ignore[arg-type]
                    limits=Limits(deadline_seconds=0.3),
                )
                out = agent("x").synchronize(HANG_GUARD)
                assert out.stop_reason == "deadline", (check, when)
                assert out.chunk_table.kinds() == ["user", "assistant", "tool_result"]
                result = json.loads(out.rows[-1].payload["content"])
                assert result["ok"] is False and result["error_kind"] == "timeout"
                if when == "tool_input":
                    assert "not run" in result["message"] and ran == []
                else:  # the tool ran, but the model never sees an unscreened result
                    assert "withheld" in result["message"] and ran == [1]
                    assert "paid" not in out.rows[-1].payload["content"]
    finally:
        release.set()
