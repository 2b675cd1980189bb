"""`Agent`: lazy and async runs, string input, structured output (tool and native), retries,
manager/worker through `as_tool`, and sharing one agent across concurrent passes."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from treadle import ConfigurationError, Session
from treadle.agents import Agent, StructuredOutputError
from treadle.llm import Provider
from treadle.loop import CompletionRequest, Limits
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.scripted import ScriptedExecutor, text, tool_call, tool_calls
from treadle.tools import tool


class City(BaseModel):
    name: str
    population: int


@tool
def lookup(city: str) -> dict[str, Any]:
    """Look up a city's population.

    Args:
        city: the city name
    """
    return {"city": city, "population": 2_100_000}


def _content(row: Any) -> dict[str, Any]:
    return json.loads(row.payload["content"])  # type: ignore[no-any-return]


def test_agent_lazy_call_with_string_input() -> None:
    ex = ScriptedExecutor([text("hello")])
    agent = Agent("greeter", "Be kind.", executor=ex)
    out = agent("hi")
    assert isinstance(out, Session)
    assert out.chunk_table.kinds() == ["user", "assistant"]
    assert out.final_text == "hello"
    assert out.stop_reason == "final_answer"
    assert [m["role"] for m in ex.requests[0].messages()] == ["system", "user"]
    assert agent.agent_session.id in out.lineage.parent_ids


async def test_agent_run_async_and_concurrent_sharing() -> None:
    ex = ScriptedExecutor(default=lambda req: text(f"echo {req.rows[-1].content}"))
    agent = Agent("echo", "Echo.", executor=ex, tools=[lookup])
    outs = await asyncio.gather(*(agent.run(f"m{i}") for i in range(50)))
    assert [o.final_text for o in outs] == [f"echo m{i}" for i in range(50)]
    # the same agent session (one system row) is reused for every pass
    assert {r.agent_rows[0].content for r in ex.requests} == {"Echo."}


def test_agent_without_provider_reads_treadle_model_as_the_cli_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    with pytest.raises(ConfigurationError, match="set TREADLE_MODEL"):
        Agent("x", "y")
    with FakeOpenAIServer("echo") as server:
        monkeypatch.setenv("TREADLE_MODEL", "env-model")
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        agent = Agent("echo", "Echo.")
        assert agent.provider is not None and agent.provider.model == "env-model"
        assert agent("hi").final_text == "hi"
        assert server.requests[0].body["model"] == "env-model"


def test_agent_configuration_errors_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    with pytest.raises(ConfigurationError, match="provider"):
        Agent("x", "y")
    with pytest.raises(ConfigurationError, match="name"):
        Agent("", "y", executor=ScriptedExecutor())
    with pytest.raises(ConfigurationError, match="BaseModel"):
        Agent("x", executor=ScriptedExecutor(), output_type=dict)
    with pytest.raises(ConfigurationError, match="structured_mode"):
        Agent("x", executor=ScriptedExecutor(), output_type=City, structured_mode="json")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="Session or a str"):
        Agent("x", executor=ScriptedExecutor())(42)  # type: ignore[arg-type]


def test_structured_output_tool_mode_after_a_tool() -> None:
    ex = ScriptedExecutor(
        [
            tool_call("lookup", {"city": "Paris"}),
            tool_call("final_result", {"name": "Paris", "population": 2_100_000}),
        ]
    )
    agent = Agent("geo", "Answer with data.", executor=ex, tools=[lookup], output_type=City)
    out = agent("Biggest French city?")
    assert out.output == City(name="Paris", population=2_100_000)
    assert out.stop_reason == "final_answer"
    assert out.chunk_table.kinds() == [
        "user",
        "assistant",
        "tool_result",
        "assistant",
        "tool_result",
    ]
    assert _content(out.rows[-1]) == {"ok": True, "accepted": True}
    schemas = {s["function"]["name"]: s for s in ex.requests[0].tool_schemas()}
    assert set(schemas) == {"lookup", "final_result"}
    assert schemas["final_result"]["function"]["parameters"]["required"] == ["name", "population"]
    assert out.interrupt_reason is None


def test_structured_output_validation_error_goes_back_to_the_model() -> None:
    ex = ScriptedExecutor(
        [
            tool_call("final_result", {"name": "Paris"}),
            tool_call("final_result", {"name": "Paris", "population": "many"}),
            tool_call("final_result", {"name": "Paris", "population": 5}),
        ]
    )
    out = Agent("geo", executor=ex, output_type=City)("?")
    assert out.output == City(name="Paris", population=5)
    errors = [_content(r) for r in out.rows if r.kind == "tool_result"][:2]
    assert [e["error_kind"] for e in errors] == ["invalid_tool_arguments"] * 2
    assert "population" in errors[0]["message"]


def test_structured_output_retries_are_bounded() -> None:
    bad = tool_call("final_result", {"name": "Paris"})
    ex = ScriptedExecutor([bad, bad, bad, bad])
    out = Agent("geo", executor=ex, output_type=City, output_retries=1)("?")
    with pytest.raises(StructuredOutputError, match="population"):
        out.synchronize()
    assert len(ex.requests) == 2


def test_structured_output_sibling_calls_get_results() -> None:
    ex = ScriptedExecutor(
        [
            tool_calls(
                [("lookup", {"city": "Lyon"}), ("final_result", {"name": "L", "population": 1})]
            )
        ]
    )
    out = Agent("geo", executor=ex, tools=[lookup], output_type=City)("?")
    results = [r for r in out.rows if r.kind == "tool_result"]
    assert [r.payload["name"] for r in results] == ["lookup", "final_result"]
    assert _content(results[0])["error_kind"] == "not_run"
    assert out.output.population == 1


def test_tool_mode_accepts_json_text_and_nudges_plain_text() -> None:
    ex = ScriptedExecutor(["I think Paris.", '{"name": "Paris", "population": 3}'])
    out = Agent("geo", executor=ex, output_type=City)("?")
    assert out.output == City(name="Paris", population=3)
    nudge = out.rows[2]
    assert nudge.kind == "user" and "final_result" in nudge.content


def test_native_mode_sends_json_schema_over_http() -> None:
    answers = iter(['{"name": "Paris"}', '{"name": "Paris", "population": 7}'])
    with FakeOpenAIServer(script=lambda req: Reply.text(next(answers))) as server:
        provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test")
        agent = Agent("geo", "Answer in JSON.", provider=provider, output_type=City,
                      structured_mode="native")  # fmt: skip
        out = agent("Biggest French city?")
        assert out.output == City(name="Paris", population=7)
        body = server.requests[0].body
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["name"] == "City"
    assert fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["additionalProperties"] is False
    assert "tools" not in body
    assert "population" in out.rows[2].content  # the validation error went back as a user row


def test_limits_stop_returns_without_output() -> None:
    ex = ScriptedExecutor(default=tool_call("lookup", {"city": "X"}))
    out = Agent("geo", executor=ex, tools=[lookup], output_type=City,
                limits=Limits(max_steps=2))("?")  # fmt: skip
    assert out.stop_reason == "max_steps"
    assert out.output is None


def test_manager_dispatches_workers_concurrently() -> None:
    started: list[str] = []
    release = asyncio.Event()

    async def worker_reply(request: CompletionRequest) -> dict[str, Any]:
        task = str(request.rows[0].content)
        started.append(task)
        if len(started) == 2:
            release.set()
        await asyncio.wait_for(release.wait(), 5)  # both workers must be in flight at once
        return text(f"done: {task}")

    class AsyncScript:
        async def acomplete(self, request: CompletionRequest) -> Any:
            return await worker_reply(request)

    worker = Agent("worker", "Do the task.", executor=AsyncScript(), description="Does a task.")
    manager_ex = ScriptedExecutor(
        [tool_calls([("worker", {"task": "a"}), ("worker", {"task": "b"})]), text("all done")]
    )
    manager = Agent("manager", "Delegate.", executor=manager_ex, tools=[worker.as_tool()])
    out = manager("split the job")
    assert out.final_text == "all done"
    results = [_content(r) for r in out.rows if r.kind == "tool_result"]
    assert [r["answer"] for r in results] == ["done: a", "done: b"]
    assert sorted(started) == ["a", "b"]
    schema = manager_ex.requests[0].tool_schemas()[0]["function"]
    assert schema["name"] == "worker" and schema["description"] == "Does a task."
    assert list(schema["parameters"]["properties"]) == ["task"]


def test_lazy_agent_cancel_is_a_stop() -> None:
    started = threading.Event()

    class Slow:
        async def acomplete(self, request: CompletionRequest) -> Any:
            started.set()
            await asyncio.Event().wait()

    out = Agent("slow", executor=Slow())("hi")
    assert started.wait(5)
    out.cancel()
    assert out.stop_reason == "cancelled"
    assert out.chunk_table.kinds() == ["user"]


def test_triage_output_with_literal() -> None:
    class Route(BaseModel):
        department: Literal["billing", "tech"]

    from treadle.agents import handoff
    from treadle.agents import triage as make_triage

    triage = Agent(
        "triage",
        "Route.",
        executor=ScriptedExecutor([tool_call("final_result", {"department": "tech"})]),
        output_type=Route,
    )
    tech_ex = ScriptedExecutor([text("Restart it.")])
    billing_ex = ScriptedExecutor()
    flow = make_triage(
        triage,
        {
            "billing": Agent("billing", executor=billing_ex),
            "tech": Agent("tech", "Fix things.", executor=tech_ex),
        },
    )
    out = flow("My laptop is broken")
    assert out.final_text == "Restart it."
    assert out.chunk_table.kinds() == ["user", "assistant"]  # fresh session: no triage rows
    assert out.metadata["handoff"] == {
        "from": "triage",
        "to": "tech",
        "decision": {"department": "tech"},
    }
    assert out.usage.requests == 2
    assert billing_ex.requests == []
    with pytest.raises(ConfigurationError, match="output_type"):
        make_triage(Agent("t", executor=billing_ex), {"x": triage})
    # the old name still builds a triage, with a deprecation warning naming the new one
    with pytest.warns(DeprecationWarning, match="triage"):
        old = handoff(triage, {"tech": Agent("tech", executor=ScriptedExecutor([text("ok")]))})
    assert type(old).__name__ == "Triage"
