"""Handoffs through the fake server: the transfer is a tool the model calls, the target continues
the same transcript under its own instructions, and the output says who answered."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from treadle import ConfigurationError, Session
from treadle.agents import Agent, AgentErrorContext, handoff, remove_tool_rows
from treadle.agents.handoffs import MAX_HANDOFFS_PER_RUN
from treadle.llm import Provider
from treadle.loop import RequestUsage, ToolGuardrail, ToolGuardrailInput
from treadle.loop.plan import unique_call_ids
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.fake_replies import ToolCallSpec
from treadle.tools import tool


@tool
def lookup(order: str) -> dict[str, Any]:
    """Look up an order.

    Args:
        order: the order id
    """
    return {"order": order, "status": "charged twice"}


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test")


def _bodies(server: FakeOpenAIServer) -> list[dict[str, Any]]:
    return [r.body for r in server.requests if r.path.endswith("/chat/completions")]


def _tool_names(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools", ())]


def test_transfer_continues_the_same_transcript(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    billing = Agent(
        "billing", "You handle refunds.", provider=provider, description="refunds and charges"
    )
    triage = Agent(
        "triage", "Route the user.", provider=provider, tools=[lookup], handoffs=[billing]
    )
    server.enqueue(
        Reply.tool_call("lookup", {"order": "A1"}),
        Reply.tool_call("transfer_to_billing", {}),
        Reply.text("Refunded the second charge."),
    )
    out = triage("I was charged twice for A1.")
    assert out.final_text == "Refunded the second charge."
    assert out.stop_reason == "final_answer"
    # rows before the handoff are kept: the lookup and the transfer, each with its result
    assert out.chunk_table.kinds() == [
        "user",
        "assistant",
        "tool_result",
        "assistant",
        "tool_result",
        "assistant",
    ]
    transfer_result = json.loads(out.rows[4].payload["content"])
    assert transfer_result["assistant"] == "billing"
    assert out.metadata["agent"] == "billing"
    assert [(h["from"], h["to"]) for h in out.metadata["handoffs"]] == [("triage", "billing")]
    bodies = _bodies(server)
    assert len(bodies) == 3
    assert "transfer_to_billing" in _tool_names(bodies[0])
    assert "refunds and charges" in json.dumps(bodies[0]["tools"])
    # the target's request: its own system prompt, then the whole transcript so far
    last = bodies[2]["messages"]
    assert last[0] == {"role": "system", "content": "You handle refunds."}
    assert [m["role"] for m in last[1:]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert "charged twice" in last[3]["content"]
    # usage covers all three requests, with one entry per request naming its agent
    assert out.usage.requests == 3
    entries = out.metadata["request_usage"]
    assert all(isinstance(e, RequestUsage) for e in entries)
    assert [e.agent for e in entries] == ["triage", "triage", "billing"]
    assert all(e.response_id for e in entries)


class Escalation(BaseModel):
    reason: str
    priority: int


def test_typed_input_callback_filter_and_is_enabled(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    seen: list[tuple[int, Escalation]] = []

    def on_escalate(session: Session, value: Escalation) -> None:
        seen.append((len(session.rows), value))

    human = Agent("human desk", "Escalations.", provider=provider)
    hidden = Agent("hidden", "Never offered.", provider=provider)
    triage = Agent(
        "triage",
        "Route.",
        provider=provider,
        tools=[lookup],
        handoffs=[
            handoff(
                human,
                tool_name="escalate",
                input_type=Escalation,
                on_handoff=on_escalate,
                input_filter=remove_tool_rows,
            ),
            handoff(hidden, is_enabled=lambda session: len(session.rows) > 99),
        ],
    )
    server.enqueue(
        Reply.tool_call("lookup", {"order": "B2"}),
        Reply.tool_call("escalate", {"reason": "fraud"}),  # invalid: priority missing
        Reply.tool_call("escalate", {"reason": "fraud", "priority": 1}),
        Reply.text("A human will call you."),
    )
    out = triage("Someone used my card.")
    assert out.final_text == "A human will call you."
    assert out.metadata["agent"] == "human desk"
    bodies = _bodies(server)
    assert _tool_names(bodies[0]) == ["lookup", "escalate"]  # `hidden` is not enabled
    # the invalid transfer went back to the model as a tool error, and the pass went on
    invalid = bodies[2]["messages"][-1]
    assert invalid["role"] == "tool"
    assert json.loads(invalid["content"])["error_kind"] == "invalid_tool_arguments"
    # on_handoff got the typed input; the filter left the human only the words
    assert [v for _, v in seen] == [Escalation(reason="fraud", priority=1)]
    assert [m["role"] for m in bodies[3]["messages"]] == ["system", "user"]
    assert out.chunk_table.kinds() == ["user", "assistant"]


def test_handoff_chain_and_configuration_errors(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    c = Agent("c", "Third.", provider=provider)
    b = Agent("b", "Second.", provider=provider, handoffs=[c])
    a = Agent("a", "First.", provider=provider, handoffs=[b])
    server.enqueue(
        Reply.tool_call("transfer_to_b", {}),
        Reply.tool_call("transfer_to_c", {}),
        Reply.text("done"),
    )
    out = a("go")
    assert out.metadata["agent"] == "c"
    assert [h["to"] for h in out.metadata["handoffs"]] == ["b", "c"]
    with pytest.raises(ConfigurationError, match="Agent to hand off to"):
        Agent("x", provider=provider, handoffs=["b"])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="one tool name"):
        Agent("x", provider=provider, handoffs=[b, handoff(c, tool_name="transfer_to_b")])


def test_sibling_calls_of_the_transfer_run_before_the_handoff(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    billing = Agent("billing", "Refunds.", provider=provider)
    triage = Agent("triage", "Route.", provider=provider, tools=[lookup], handoffs=[billing])
    server.enqueue(
        Reply.tool_calls_of([("transfer_to_billing", {}), ("lookup", {"order": "C3"})]),
        Reply.text("ok"),
    )
    out = triage("hi")
    results = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert results[0]["assistant"] == "billing"
    assert results[1]["status"] == "charged twice"  # the lookup ran, like any call of the round
    assert out.metadata["agent"] == "billing"
    assert server.request_count == 2


def test_a_guardrail_rejecting_or_replacing_the_transfer_stops_the_handoff(
    server: FakeOpenAIServer,
) -> None:
    provider = _provider(server)
    billing = Agent("billing", "Refunds.", provider=provider)

    def no_transfers(data: ToolGuardrailInput) -> str | None:
        return "transfers are closed" if data.call.name.startswith("transfer_to_") else None

    for when in ("tool_input", "tool_output"):
        triage = Agent(
            "triage",
            "Route.",
            provider=provider,
            handoffs=[billing],
            guardrails=[ToolGuardrail(no_transfers, when)],
        )
        server.enqueue(Reply.tool_call("transfer_to_billing", {}), Reply.text("triage keeps it"))
        out = triage("refund")
        assert out.metadata["agent"] == "triage", when
        assert "handoffs" not in out.metadata
        assert out.final_text == "triage keeps it"


def test_a_disabled_transfer_the_model_calls_anyway_is_no_handoff(
    server: FakeOpenAIServer,
) -> None:
    provider = _provider(server)
    ran: list[str] = []
    humans = Agent("humans", "People.", provider=provider)
    for enabled in (False, lambda session: False):
        triage = Agent(
            "triage",
            "Route.",
            provider=provider,
            handoffs=[handoff(humans, is_enabled=enabled, on_handoff=lambda s: ran.append("x"))],
        )
        server.enqueue(Reply.tool_call("transfer_to_humans", {}), Reply.text("triage answers"))
        out = triage("a person please")
        assert out.metadata["agent"] == "triage"
        assert "handoffs" not in out.metadata
        assert out.final_text == "triage answers"
        result = next(r for r in out.rows if r.kind == "tool_result")
        assert "assistant" not in json.loads(result.payload["content"])
    assert ran == []


class Reason(BaseModel):
    reason: str


@pytest.mark.parametrize(
    ("arguments", "agent"),
    [
        ('{"reason": "\\ud83d\\ude00"}', "humans"),  # an escaped surrogate pair: one emoji
        # A lone surrogate escape: bad JSON to the dispatcher (no file could hold the text), so
        # the transfer fails as a tool call and no handoff claims otherwise.
        ('{"reason": "\\ud800"}', "triage"),
    ],
)
def test_typed_input_is_validated_once_and_the_result_matches_the_handoff(
    server: FakeOpenAIServer, arguments: str, agent: str
) -> None:
    provider = _provider(server)
    humans = Agent("humans", "People.", provider=provider)
    seen: list[Reason] = []
    triage = Agent(
        "triage",
        "Route.",
        provider=provider,
        handoffs=[
            handoff(
                humans,
                tool_name="escalate",
                input_type=Reason,
                on_handoff=lambda s, v: seen.append(v),
            )
        ],
    )
    server.enqueue(Reply.tool_call("escalate", arguments), Reply.text(agent))
    out = triage("x")
    result = json.loads(next(r for r in out.rows if r.kind == "tool_result").payload["content"])
    assert out.metadata["agent"] == agent
    if agent == "humans":
        assert result.get("assistant") == "humans"
        assert [v.reason for v in seen] == ["\U0001f600"]
    else:
        assert result["error_kind"] == "invalid_tool_arguments" and "assistant" not in result
        assert seen == []


def test_only_the_first_of_two_transfers_in_one_reply_takes_effect(
    server: FakeOpenAIServer,
) -> None:
    provider = _provider(server)
    called: list[str] = []
    billing = Agent("billing", "Refunds.", provider=provider)
    support = Agent("support", "Help.", provider=provider)
    triage = Agent(
        "triage",
        "Route.",
        provider=provider,
        tools=[lookup],
        handoffs=[
            handoff(billing, on_handoff=lambda s: called.append("billing")),
            handoff(support, on_handoff=lambda s: called.append("support")),
        ],
    )
    server.enqueue(
        Reply.tool_calls_of(
            [
                ("lookup", {"order": "D4"}),
                ("transfer_to_billing", {}),
                ("transfer_to_support", {}),
                ("transfer_to_billing", {}),
            ]
        ),
        Reply.text("billing here"),
    )
    out = triage("refund D4")
    results = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert results[0]["status"] == "charged twice"  # an ordinary sibling call runs as usual
    assert results[1]["assistant"] == "billing"  # the first transfer takes over
    for ignored, name in ((results[2], "transfer_to_support"), (results[3], "transfer_to_billing")):
        assert ignored["ok"] is False
        assert ignored["error_kind"] == "handoff_ignored"
        assert ignored["message"].startswith("Multiple handoffs detected, ignoring this one")
        assert name in ignored["message"] and "transfer_to_billing" in ignored["message"]
    assert called == ["billing"]
    assert out.metadata["agent"] == "billing"
    assert [h["to"] for h in out.metadata["handoffs"]] == ["billing"]
    assert out.final_text == "billing here"
    # the target's request carries every result, the ignored ones too
    last = _bodies(server)[-1]["messages"]
    assert [m["role"] for m in last].count("tool") == 4


def test_an_invalid_first_transfer_means_no_transfer_in_that_reply(
    server: FakeOpenAIServer,
) -> None:
    provider = _provider(server)
    humans = Agent("humans", "People.", provider=provider)
    billing = Agent("billing", "Refunds.", provider=provider)
    triage = Agent(
        "triage",
        "Route.",
        provider=provider,
        handoffs=[handoff(humans, tool_name="escalate", input_type=Reason), billing],
    )
    server.enqueue(
        Reply.tool_calls_of([("escalate", {"why": 1}), ("transfer_to_billing", {})]),
        Reply.text("triage still here"),
    )
    out = triage("help")
    results = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert results[0]["error_kind"] == "invalid_tool_arguments"
    assert results[1]["error_kind"] == "handoff_ignored"
    assert out.metadata["agent"] == "triage"
    assert "handoffs" not in out.metadata
    assert out.final_text == "triage still here"


@pytest.mark.parametrize("stream", [False, True])
def test_two_transfers_sharing_a_call_id_hand_off_to_the_first_only(
    server: FakeOpenAIServer, stream: bool
) -> None:
    provider = Provider(
        model="fake-model", base_url=server.base_url, api_key="sk-test", stream=stream
    )
    billing = Agent("billing", "Refunds.", provider=provider)
    support = Agent("support", "Help.", provider=provider)
    triage = Agent("triage", "Route.", provider=provider, handoffs=[billing, support])
    twice = (
        ToolCallSpec("transfer_to_billing", "{}", "call_0"),
        ToolCallSpec("transfer_to_support", "{}", "call_0"),
    )
    server.enqueue(Reply(tool_calls=twice), Reply.text("billing here"))
    out = triage("refund")
    assert out.metadata["agent"] == "billing"
    assert out.metadata["handoffs"] == [
        {"from": "triage", "to": "billing", "tool_call_id": "call_0"}
    ]
    assert out.final_text == "billing here"
    # the second call got its own id, so each call has exactly one result row
    [assistant] = [r for r in out.rows if r.kind == "assistant" and r.calls]
    assert [c.id for c in assistant.calls] == ["call_0", "call_0_1"]
    results = {r.payload["tool_call_id"]: r for r in out.rows if r.kind == "tool_result"}
    assert json.loads(results["call_0"].payload["content"]) == {"ok": True, "assistant": "billing"}
    ignored = json.loads(results["call_0_1"].payload["content"])
    assert ignored["error_kind"] == "handoff_ignored"
    last = _bodies(server)[-1]["messages"]
    assert [m["tool_call_id"] for m in last if m["role"] == "tool"] == ["call_0", "call_0_1"]


def test_call_ids_are_made_distinct_and_non_empty() -> None:
    same = {"tool_calls": [{"id": "a"}, {"id": "b"}]}
    assert unique_call_ids(same) is same  # nothing to fix: no copy
    assert unique_call_ids({"content": "hi"}) == {"content": "hi"}
    fixed = unique_call_ids(
        {"tool_calls": [{"id": "x"}, {"id": ""}, {"id": "x"}, {"id": "call_1"}]}
    )
    assert [c["id"] for c in fixed["tool_calls"]] == ["x", "call_1_", "x_2", "call_1"]


def test_the_handoff_cap_calls_the_max_turns_handler() -> None:
    def script(request: dict[str, Any]) -> Reply:
        step = int(request["messages"][0]["content"].removeprefix("Step "))
        return Reply.tool_call(f"transfer_to_s{step + 1}", {})

    contexts: list[AgentErrorContext] = []

    def out_of_turns(ctx: AgentErrorContext) -> str:
        contexts.append(ctx)
        return "too many transfers"

    with FakeOpenAIServer(script=script) as server:
        provider = _provider(server)
        chain = Agent(f"s{MAX_HANDOFFS_PER_RUN + 2}", "Last.", provider=provider)
        for step in range(MAX_HANDOFFS_PER_RUN + 1, -1, -1):  # each hands off to the next
            chain = Agent(
                f"s{step}",
                f"Step {step}",
                provider=provider,
                handoffs=[chain],
                error_handlers={"max_turns": out_of_turns},
            )
        out = chain("go").synchronize()
    assert len(out.metadata["handoffs"]) == MAX_HANDOFFS_PER_RUN
    assert out.stop_reason == "max_steps"
    assert out.final_text == "too many transfers"
    assert out.metadata["handled_error"] == "max_turns"
    assert [c.agent for c in contexts] == [f"s{MAX_HANDOFFS_PER_RUN}"]


def test_a_handoff_with_an_input_filter_is_refused_on_a_stored_conversation(tmp_path: Any) -> None:
    """A store keeps every row of the conversation: the filter could not hide them from the
    target, whose input (the filtered rows) would be added after them again."""
    from treadle.stores import Store
    from treadle.testing import ScriptedExecutor

    billing = Agent("billing", "You bill.", executor=ScriptedExecutor(["billed"]))
    middle = Agent(
        "middle", "Route.", executor=ScriptedExecutor(["x"]),
        handoffs=[handoff(billing, input_filter=remove_tool_rows)],
    )  # fmt: skip
    triage = Agent("triage", "Route.", executor=ScriptedExecutor(["x"]), handoffs=[middle])
    with Store.sqlite(tmp_path / "s.db") as store:
        out = triage(Session.from_user_message("refund"), store=store, conversation="k")
        with pytest.raises(ConfigurationError, match="from 'middle' to 'billing' has an input_f"):
            out.synchronize()
        assert store.conversation("k").rows == ()
        # Without the filter the same run commits once, the user's message once.
        plain = Agent("triage", "Route.", executor=ScriptedExecutor(["hi"]), handoffs=[billing])
        plain(Session.from_user_message("refund"), store=store, conversation="k").synchronize()
        assert [r.kind for r in store.conversation("k").rows] == ["user", "assistant"]
