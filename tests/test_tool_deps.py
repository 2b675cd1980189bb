"""Deps for a pass: `Agent[Deps, Output]`, `ToolContext[Deps]`, and where deps may never go.

Against the fake server over loopback HTTP: the deps a caller passes reach tools, guardrails and
callbacks that ask for a `ToolContext` by annotation, and never reach the transcript or a file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from treadle import Agent, Limits, Provider, Session, run_session_loop
from treadle.errors import ConfigurationError
from treadle.loop import GuardrailInput, PassControl, before_model
from treadle.session import ChunkRow, Usage
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply
from treadle.tools import ToolContext, tool
from treadle.tools.context import context_parameter

SECRET = "s3cr3t-token-d6f1"


@dataclass
class Deps:
    """What a user's app hands its tools: a token and a customer record."""

    token: str
    customer: str


def _provider(server: FakeOpenAIServer, **kw: Any) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test", **kw)


@tool
def whoami(ctx: ToolContext[Deps]) -> str:
    """Name the customer this conversation is for."""
    return f"{ctx.deps.customer} ({ctx.tool_call_id}, {ctx.usage.total_tokens} tokens so far)"


def test_deps_reach_a_typed_tool_through_an_agent(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.tool_call("whoami", {}), Reply.text("done"))
    agent = Agent("support", "Help.", tools=[whoami], provider=_provider(server), deps_type=Deps)
    assert "ctx" not in whoami.parameters["properties"]
    out = agent("who am I?", deps=Deps(SECRET, "ACME"))
    assert out.final_text == "done"
    result = json.loads(out.rows[2].payload["content"])
    call_id = out.rows[1].tool_calls[0]["id"]
    match = re.fullmatch(rf"ACME \({call_id}, (\d+) tokens so far\)", result["result"])
    assert match is not None, result
    assert int(match.group(1)) > 0  # the usage so far counts the first request


def test_an_agent_with_deps_type_refuses_a_run_without_deps(server: FakeOpenAIServer) -> None:
    agent = Agent("support", "Help.", provider=_provider(server), deps_type=Deps)
    with pytest.raises(ConfigurationError, match="deps_type=Deps; pass deps"):
        agent("hi")
    with pytest.raises(ConfigurationError, match="takes deps of type Deps, got str"):
        agent("hi", deps="not deps")  # type: ignore[arg-type]


def test_deps_reach_guardrails_and_callbacks_that_ask(server: FakeOpenAIServer) -> None:
    seen: dict[str, Any] = {}

    @before_model
    def check(data: GuardrailInput, context: ToolContext[Deps]) -> bool:
        seen["guardrail"] = context.deps
        return False

    def plain(data: GuardrailInput) -> None:
        seen["plain"] = data.session.id  # a check that does not ask gets no context

    async def on_message(row: ChunkRow, control: PassControl, ctx: ToolContext[Deps]) -> None:
        seen.setdefault("rows", []).append((row.kind, ctx.deps.customer))

    def over_budget(session: Session, usage: Usage, ctx: ToolContext[Deps]) -> None:
        seen["budget"] = (ctx.deps.customer, usage.total_tokens)

    out = run_session_loop(
        Session.from_user_message("hello"),
        Session.from_agent_prompt("Help."),
        agent_provider=_provider(server, budget_total_tokens=1, on_budget_exceeded=over_budget),
        guardrails=[check, plain],
        on_message=on_message,
        deps=Deps(SECRET, "ACME"),
    )
    assert out.stop_reason == "final_answer"
    assert seen["guardrail"] == Deps(SECRET, "ACME")
    assert seen["plain"] == out.id
    assert seen["rows"] == [("assistant", "ACME")]
    assert seen["budget"][0] == "ACME" and seen["budget"][1] > 0


def test_deps_are_never_written_to_the_transcript_or_the_file(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(Reply.tool_call("whoami", {}), Reply.text("done"))
    path = tmp_path / "pass.jsonl"
    out = run_session_loop(
        Session.from_user_message("who am I?"),
        Session.from_agent_prompt("Help."),
        agent_provider=_provider(server),
        tools=[whoami],
        persist_path=path,
        deps=Deps(SECRET, "ACME"),
        limits=Limits(max_steps=4),
    )
    assert out.final_text == "done"
    text = path.read_text()
    assert "ACME" in text  # the tool's result is in the file, as the model saw it
    assert SECRET not in text
    assert SECRET not in json.dumps(out.to_messages())
    assert SECRET not in repr(out.metadata)
    assert all(SECRET not in json.dumps(r.body) for r in server.requests)
    assert SECRET not in Session.load(path).rows.__repr__()


def test_context_is_found_by_annotation_even_beside_an_unresolvable_one() -> None:
    def check(data: Undefined, ctx: ToolContext[Deps]) -> None:  # type: ignore[name-defined]  # noqa: F821
        return None

    def named_like_it(data: GuardrailInput, context: Deps) -> None:
        return None  # a parameter called `context` is not a context: only the type counts

    assert context_parameter(check) == "ctx"
    assert context_parameter(named_like_it) is None
    assert before_model(check).context_param == "ctx"


class HasToken(Protocol):
    """A deps protocol (not runtime-checkable: only a type checker can check it)."""

    token: str


def test_a_protocol_deps_type_is_left_to_the_type_checker(server: FakeOpenAIServer) -> None:
    agent = Agent("p", "Help.", provider=_provider(server), deps_type=HasToken)
    out = agent("hi", deps=Deps(SECRET, "ACME"))
    assert out.stop_reason == "final_answer"
