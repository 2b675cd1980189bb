"""Hooks, soft cancel, per-request usage entries, streaming an agent run and agents as tools,
all through the fake server."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from pydantic import BaseModel

from treadle import ConfigurationError, Session
from treadle.agents import Agent, AgentPassEvent, AgentRunStopped, HandoffEvent
from treadle.llm import Provider
from treadle.loop import HookContext, Hooks, RequestUsage, run_session_loop
from treadle.session import ChunkRow, ToolCall
from treadle.testing import FakeOpenAIServer, Reply
from treadle.tools import tool

HANG_GUARD = 120.0


@tool
def lookup(order: str) -> dict[str, Any]:
    """Look up an order.

    Args:
        order: the order id
    """
    return {"order": order, "status": "shipped"}


def _provider(server: FakeOpenAIServer, **options: Any) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test", **options)


class Recorder(Hooks):
    """Sync and async hooks mixed: both kinds must be called, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_agent_start(self, ctx: HookContext) -> None:
        self.calls.append(f"agent_start:{ctx.agent}")

    async def on_agent_end(self, ctx: HookContext, output: Any) -> None:
        self.calls.append(f"agent_end:{ctx.agent}:{output}")

    async def on_model_start(self, ctx: HookContext, messages: list[dict[str, Any]]) -> None:
        self.calls.append(f"model_start:{ctx.agent}:{len(messages)}")

    def on_model_end(self, ctx: HookContext, row: ChunkRow) -> None:
        self.calls.append(f"model_end:{ctx.agent}")

    def on_tool_start(self, ctx: HookContext, call: ToolCall) -> None:
        self.calls.append(f"tool_start:{call.name}")

    async def on_tool_end(self, ctx: HookContext, call: ToolCall, row: ChunkRow) -> None:
        body = json.loads(row.payload["content"])
        self.calls.append(f"tool_end:{call.name}:{body.get('status', body.get('assistant'))}")

    def on_handoff(self, ctx: HookContext, source: str, target: str) -> None:
        self.calls.append(f"handoff:{source}->{target}")


def test_hooks_see_agent_model_tool_and_handoff(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    billing = Agent("billing", "Refunds.", provider=provider)
    hooks = Recorder()
    triage = Agent("triage", "Route.", provider=provider, tools=[lookup], handoffs=[billing])
    server.enqueue(
        Reply.tool_call("lookup", {"order": "A1"}),
        Reply.tool_call("transfer_to_billing", {}),
        Reply.text("refunded"),
    )
    out = triage("refund A1", hooks=hooks)  # a run's hooks follow the conversation
    assert out.final_text == "refunded"
    assert hooks.calls == [
        "agent_start:triage",
        "model_start:triage:2",
        "model_end:triage",
        "tool_start:lookup",
        "tool_end:lookup:shipped",
        "model_start:triage:4",
        "model_end:triage",
        "tool_start:transfer_to_billing",
        "tool_end:transfer_to_billing:billing",
        "handoff:triage->billing",
        "agent_start:billing",
        "model_start:billing:6",
        "model_end:billing",
        "agent_end:billing:refunded",
    ]


def test_agent_hooks_belong_to_their_agent(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    billing_hooks, triage_hooks = Recorder(), Recorder()
    billing = Agent("billing", "Refunds.", provider=provider, hooks=billing_hooks)
    triage = Agent("triage", "Route.", provider=provider, handoffs=[billing], hooks=triage_hooks)
    server.enqueue(Reply.tool_call("transfer_to_billing", {}), Reply.text("refunded"))
    triage("refund").synchronize(HANG_GUARD)
    assert triage_hooks.calls == [
        "agent_start:triage",
        "model_start:triage:2",
        "model_end:triage",
        "tool_start:transfer_to_billing",
        "tool_end:transfer_to_billing:billing",
        "handoff:triage->billing",
    ]
    assert billing_hooks.calls == [
        "agent_start:billing",
        "model_start:billing:4",
        "model_end:billing",
        "agent_end:billing:refunded",
    ]


def test_hooks_per_pass_and_per_run(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    pass_hooks = Recorder()
    out = run_session_loop(
        Session.from_user_message("hi"),
        Session.from_agent_prompt("Echo."),
        agent_provider=provider,
        hooks=pass_hooks,
    )
    assert out.stop_reason == "final_answer"
    assert pass_hooks.calls == ["model_start:None:2", "model_end:None"]
    run_hooks, agent_hooks = Recorder(), Recorder()
    agent = Agent("echo", "Echo.", provider=provider, hooks=agent_hooks)
    agent("hello", hooks=run_hooks).synchronize(HANG_GUARD)
    assert run_hooks.calls[0] == "agent_start:echo"
    assert run_hooks.calls[-1].startswith("agent_end:echo:")
    assert agent_hooks.calls == run_hooks.calls  # both are called, the run's first


def test_soft_cancel_finishes_the_turn_then_stops(server: FakeOpenAIServer) -> None:
    started = threading.Event()
    release = threading.Event()

    @tool
    def slow(order: str) -> str:
        """Slow lookup.

        Args:
            order: the order id
        """
        started.set()
        release.wait(HANG_GUARD)
        return "found"

    agent = Agent("clerk", "Look things up.", provider=_provider(server), tools=[slow])
    server.enqueue(Reply.tool_call("slow", {"order": "Z"}), Reply.text("never asked"))
    out = agent("find Z")
    assert started.wait(HANG_GUARD)
    out.cancel(after_turn=True)
    release.set()
    out.synchronize(HANG_GUARD)
    assert out.stop_reason == "cancelled"
    assert out.metadata["cancel_mode"] == "after_turn"
    # the turn finished: the tool ran and its result is in the transcript; no second request
    assert out.chunk_table.kinds() == ["user", "assistant", "tool_result"]
    assert json.loads(out.rows[-1].payload["content"])["result"] == "found"
    assert server.request_count == 1
    # resumable like every stop: the next run answers from where it stopped
    again = agent(out)
    assert again.final_text == "never asked"


def test_soft_cancel_of_a_bare_pass(server: FakeOpenAIServer) -> None:
    started = threading.Event()
    release = threading.Event()

    @tool
    def wait_here() -> str:
        """Wait."""
        started.set()
        release.wait(HANG_GUARD)
        return "ok"

    server.enqueue(Reply.tool_call("wait_here", {}), Reply.text("more"))
    out = run_session_loop(
        Session.from_user_message("go"),
        Session.from_agent_prompt("Wait."),
        agent_provider=_provider(server),
        tools=[wait_here],
    )
    assert started.wait(HANG_GUARD)
    out.cancel(after_turn=True)
    release.set()
    assert out.synchronize(HANG_GUARD).stop_reason == "cancelled"
    assert out.chunk_table.kinds() == ["user", "assistant", "tool_result"]


def _completion_with_details(content: str) -> bytes:
    body = {
        "id": "chatcmpl-details-1",
        "object": "chat.completion",
        "created": 0,
        "model": "fake-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 30,
            "total_tokens": 150,
            "prompt_tokens_details": {"cached_tokens": 100},
            "completion_tokens_details": {"reasoning_tokens": 12},
        },
    }
    return json.dumps(body).encode()


def test_per_request_usage_entries_beside_the_totals(server: FakeOpenAIServer) -> None:
    provider = _provider(server, stream=False)
    server.enqueue(
        Reply.tool_call("lookup", {"order": "A"}).with_usage(50, 5),
        Reply.raw(_completion_with_details("done")),
    )
    agent = Agent("clerk", "Look up.", provider=provider, tools=[lookup])
    out = agent("status of A")
    first, second = out.metadata["request_usage"]
    assert isinstance(first, RequestUsage)
    assert (first.input_tokens, first.output_tokens, first.cached_tokens) == (50, 5, 0)
    assert (second.input_tokens, second.output_tokens) == (120, 30)
    assert (second.cached_tokens, second.reasoning_tokens) == (100, 12)
    assert second.response_id == "chatcmpl-details-1"
    assert second.total_tokens == 150
    assert first.latency_seconds >= 0 and second.latency_seconds >= 0
    # the totals are the sum of the entries
    assert out.usage.prompt_tokens == 170
    assert out.usage.completion_tokens == 35
    assert out.usage.requests == 2


class Brief(BaseModel):
    topic: str
    words: int


async def test_stream_an_agent_run_with_agent_tool_and_handoff(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    researcher = Agent("researcher", "Research.", provider=provider)
    writer = Agent("writer", "Write.", provider=provider)
    manager = Agent(
        "manager",
        "Manage.",
        provider=provider,
        tools=[
            researcher.as_tool(
                input_type=Brief, output_extractor=lambda out: out.final_text.upper()
            )
        ],
        handoffs=[writer],
    )
    server.enqueue(
        Reply.tool_call("researcher", {"topic": "bees", "words": 10}),
        Reply.text("bees make honey"),  # the researcher's answer
        Reply.tool_call("transfer_to_writer", {}),
        Reply.text("A poem about bees."),
    )
    events = [e async for e in manager.stream("write about bees")]
    last = events[-1]
    assert isinstance(last, AgentRunStopped)
    assert last.agent == "writer"
    assert last.session.final_text == "A poem about bees."
    handoffs = [e for e in events if isinstance(e, HandoffEvent)]
    assert [(e.agent, e.target) for e in handoffs] == [("manager", "writer")]
    rows = [(e.agent, e.event.type) for e in events if isinstance(e, AgentPassEvent)]
    agents_seen = [a for a, kind in rows if kind == "assistant_row"]
    assert agents_seen == ["manager", "researcher", "manager", "writer"]
    # the agent tool got structured input (as JSON) and returned what the extractor chose
    bodies = [r.body for r in server.requests]
    assert json.loads(bodies[1]["messages"][-1]["content"]) == {"topic": "bees", "words": 10}
    tool_row = next(r for r in last.session.rows if r.kind == "tool_result")
    assert json.loads(tool_row.payload["content"])["result"] == "BEES MAKE HONEY"


async def test_leaving_the_stream_early_cancels_the_run(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.text("one").with_latency(10), Reply.text("two"))
    agent = Agent("a", "Talk.", provider=_provider(server))
    stream = agent.stream("hi")
    async for _event in stream:
        break
    await asyncio.wait_for(stream.aclose(), HANG_GUARD)  # type: ignore[attr-defined]


def test_dynamic_instructions_are_computed_per_pass(server: FakeOpenAIServer) -> None:
    async def by_length(session: Session) -> str:
        return f"The conversation has {len(session.rows)} rows."

    agent = Agent("counter", by_length, provider=_provider(server), tools=[lookup])
    server.enqueue(Reply.text("first"))
    first = agent("hi")
    assert first.final_text == "first"
    server.enqueue(Reply.text("second"))
    agent(first.add_user_message("again")).synchronize(HANG_GUARD)
    systems = [r.body["messages"][0]["content"] for r in server.requests]
    assert systems == ["The conversation has 1 rows.", "The conversation has 3 rows."]
    bad = Agent("bad", lambda session: 42, provider=_provider(server))
    with pytest.raises(ConfigurationError, match="must return the system prompt"):
        bad("hi").synchronize(HANG_GUARD)


def test_run_settings_override_every_agent_of_the_run(server: FakeOpenAIServer) -> None:
    from treadle.agents import RunSettings
    from treadle.loop import Limits

    with FakeOpenAIServer(script="echo") as other:
        unused = Provider(model="never-used", base_url=server.base_url, api_key="sk-test")
        target = Agent("target", "Second.", provider=unused)
        first = Agent("first", "First.", provider=unused, tools=[lookup], handoffs=[target])
        other.enqueue(Reply.tool_call("transfer_to_target", {}), Reply.tool_call("lookup", {}))
        settings = RunSettings(
            provider=Provider(model="override", base_url=other.base_url, api_key="k"),
            limits=Limits(max_steps=1),
        )
        out = first("go", settings=settings)
        assert out.stop_reason == "max_steps"  # the override's limit, in the handoff target too
        assert out.metadata["agent"] == "target"
        assert {r.body["model"] for r in other.requests} == {"override"}
    assert server.request_count == 0
    with pytest.raises(ConfigurationError, match=r"RunSettings\.limits"):
        RunSettings(limits=3)  # type: ignore[arg-type]


def test_an_agent_used_as_a_tool_inherits_the_run_settings(server: FakeOpenAIServer) -> None:
    from treadle.agents import RunSettings

    with FakeOpenAIServer(script="echo") as other:
        unused = Provider(model="never-used", base_url=server.base_url, api_key="sk-test")
        helper = Agent("helper", "Help.", provider=unused)
        boss = Agent("boss", "Delegate.", provider=unused, tools=[helper.as_tool()])
        other.enqueue(
            Reply.tool_call("helper", {"task": "sum it"}), Reply.text("4"), Reply.text("done")
        )
        settings = RunSettings(provider=Provider(model="inherited", base_url=other.base_url))
        assert boss("go", settings=settings).final_text == "done"
        assert [r.body["model"] for r in other.requests] == ["inherited"] * 3
    assert server.request_count == 0


def test_a_raising_agent_hook_fails_its_run_once_wrapped(server: FakeOpenAIServer) -> None:
    from treadle.errors import HookError

    class Broken(Hooks):
        def on_agent_start(self, ctx: HookContext) -> None:
            raise RuntimeError("broken hook")

    agent = Agent("a", "Talk.", provider=_provider(server), hooks=Broken())
    with pytest.raises(HookError) as info:
        agent("hi", hooks=Recorder()).synchronize(HANG_GUARD)
    assert str(info.value).count("raised") == 1
    assert "RuntimeError: broken hook" in str(info.value)
    assert server.request_count == 0


def test_soft_cancel_on_a_turn_ending_in_a_transfer_makes_no_handoff(
    server: FakeOpenAIServer,
) -> None:
    started = threading.Event()
    release = threading.Event()

    @tool
    def note(text: str) -> str:
        """Note something.

        Args:
            text: what to note
        """
        started.set()
        release.wait(HANG_GUARD)
        return "noted"

    provider = _provider(server)
    billing = Agent("billing", "Refunds.", provider=provider)
    triage = Agent("triage", "Route.", provider=provider, tools=[note], handoffs=[billing])
    server.enqueue(
        Reply.tool_calls_of([("note", {"text": "r"}), ("transfer_to_billing", {})]),
        Reply.text("billing answers"),
    )
    out = triage("refund please")
    assert started.wait(HANG_GUARD)
    out.cancel(after_turn=True)
    release.set()
    out.synchronize(HANG_GUARD)
    assert out.stop_reason == "cancelled"
    assert out.metadata["cancel_mode"] == "after_turn"
    assert out.metadata["agent"] == "triage"
    assert "handoffs" not in out.metadata
    # the finished turn's rows are kept; the target was never asked
    assert out.chunk_table.kinds() == ["user", "assistant", "tool_result", "tool_result"]
    assert server.request_count == 1


def test_a_hook_raising_cancelled_error_is_a_hook_error(server: FakeOpenAIServer) -> None:
    from treadle.errors import HookError

    class ToolEnd(Hooks):
        async def on_tool_end(self, ctx: HookContext, call: ToolCall, row: ChunkRow) -> None:
            raise asyncio.CancelledError()

    class AgentEnd(Hooks):
        async def on_agent_end(self, ctx: HookContext, output: Any) -> None:
            raise asyncio.CancelledError()

    agent = Agent("a", "Talk.", provider=_provider(server), tools=[lookup])
    for hooks in (ToolEnd(), AgentEnd()):
        server.enqueue(Reply.tool_call("lookup", {"order": "A1"}), Reply.text("done"))
        out = agent("hi", hooks=hooks)
        with pytest.raises(HookError, match="raised CancelledError without being cancelled"):
            out.synchronize(HANG_GUARD)


def test_provider_usage_details_are_checked_against_the_totals(server: FakeOpenAIServer) -> None:
    def raw(cached: Any, reasoning: Any, response_id: str) -> bytes:
        body = json.loads(_completion_with_details("ok"))
        body["id"] = response_id
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return json.dumps(body).encode()

    agent = Agent("d", "Talk.", provider=_provider(server, stream=False))
    cases = [(99_999, 31, "a" * 100_000), (-5, 1.5, "id\x00\r\nX-Evil: 1"), (100, 12, "ok-id")]
    for cached, reasoning, response_id in cases:
        server.enqueue(Reply.raw(raw(cached, reasoning, response_id)))
        [entry] = agent("hi").metadata["request_usage"]
        assert 0 <= entry.cached_tokens <= entry.input_tokens == 120
        assert 0 <= entry.reasoning_tokens <= entry.output_tokens == 30
        assert len(entry.response_id) <= 256 and entry.response_id.isprintable()
    assert (entry.cached_tokens, entry.reasoning_tokens, entry.response_id) == (100, 12, "ok-id")


def test_an_entry_keeps_the_request_id_printable_and_capped() -> None:
    from treadle.loop.plan import plain_metadata
    from treadle.loop.request_usage import request_usage_of
    from treadle.session import Usage

    usage = Usage(prompt_tokens=10, completion_tokens=2, requests=1)
    entry = request_usage_of(None, "chatcmpl-1", usage, 0.5, "req_abc\r\nX-Evil: 1", "clerk")
    assert entry.request_id == "req_abcX-Evil: 1" and entry.response_id == "chatcmpl-1"
    assert len(request_usage_of(None, "", usage, 0, "r" * 10_000, None).request_id) == 256
    assert request_usage_of(None, "", usage, 0, "", None).request_id == ""  # no id at all
    [plain] = plain_metadata({"request_usage": (entry,)})["request_usage"]
    assert plain["request_id"] == "req_abcX-Evil: 1"  # the trailer keeps it too
