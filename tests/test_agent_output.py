"""Output validators (`ModelRetry`), refusals as their own error, and error handlers for max
turns, refusals and invalid output, through the fake server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from treadle import ConfigurationError, Session
from treadle.agents import Agent, AgentErrorContext, StructuredOutputError
from treadle.errors import ModelRefusalError, ModelRetry
from treadle.llm import Provider
from treadle.testing import FakeOpenAIServer, Reply
from treadle.tools import tool


class City(BaseModel):
    name: str
    population: int


@tool
def census(city: str) -> int:
    """Count people.

    Args:
        city: the city
    """
    return 2_100_000


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="fake-model", base_url=server.base_url, api_key="sk-test")


def _capitalised(city: City) -> City:
    if not city.name[:1].isupper():
        raise ModelRetry("the name must start with a capital letter")
    return city


def test_validator_sends_the_model_back_in_tool_mode(server: FakeOpenAIServer) -> None:
    agent = Agent(
        "geo", "Answer.", provider=_provider(server), output_type=City,
        output_validators=[_capitalised],
    )  # fmt: skip
    server.enqueue(
        Reply.tool_call("final_result", {"name": "paris", "population": 2}),
        Reply.tool_call("final_result", {"name": "Paris", "population": 2}),
    )
    out = agent("biggest French city?")
    assert out.output == City(name="Paris", population=2)
    retry = server.requests[1].body["messages"][-1]
    assert retry["role"] == "tool"
    body = json.loads(retry["content"])
    assert body["error_kind"] == "retry"
    assert "capital letter" in body["message"]


def test_validator_on_text_and_bounded_retries(server: FakeOpenAIServer) -> None:
    seen: list[tuple[int, str]] = []

    async def no_apologies(session: Session, text: str) -> str:
        seen.append((len(session.rows), text))
        if "sorry" in text.lower():
            raise ModelRetry("do not apologise, answer")
        return text.strip()

    agent = Agent("terse", "Answer.", provider=_provider(server), output_validators=[no_apologies])
    server.enqueue(Reply.text("Sorry, I cannot."), Reply.text("  42  "))
    out = agent("answer?")
    assert out.final_text == "  42  "
    assert out.output == "42"  # the validator's value
    assert server.requests[1].body["messages"][-1]["content"].endswith("do not apologise, answer")
    assert [n for n, _ in seen] == [2, 4]

    stubborn = Agent(
        "stubborn", "Answer.", provider=_provider(server),
        output_validators=[no_apologies], output_retries=1,
    )  # fmt: skip
    server.enqueue(Reply.text("sorry"), Reply.text("so sorry"))
    with pytest.raises(StructuredOutputError, match="validators rejected"):
        stubborn("answer?").synchronize(120)


async def test_refusal_is_its_own_error_and_is_not_retried(server: FakeOpenAIServer) -> None:
    agent = Agent("geo", "Answer.", provider=_provider(server), output_type=City)
    server.enqueue(Reply(content=None, message_extra={"refusal": "I can't help with that."}))
    with pytest.raises(ModelRefusalError, match="refused") as info:
        await agent.run("something bad")
    assert info.value.refusal == "I can't help with that."
    assert server.request_count == 1  # a structured-output retry would have asked again


def test_error_handlers_choose_the_result(server: FakeOpenAIServer) -> None:
    contexts: list[AgentErrorContext] = []

    def on_max_turns(ctx: AgentErrorContext) -> str:
        contexts.append(ctx)
        return "I ran out of steps; here is what I know."

    looping = Agent(
        "looper", "Count.", provider=_provider(server), tools=[census], max_tool_rounds=1,
        error_handlers={"max_turns": on_max_turns},
    )  # fmt: skip
    server.enqueue(
        Reply.tool_call("census", {"city": "Paris"}), Reply.tool_call("census", {"city": "Lyon"})
    )
    out = looping("count")
    assert out.stop_reason == "max_steps"
    assert out.final_text == "I ran out of steps; here is what I know."
    assert out.metadata["handled_error"] == "max_turns"
    assert contexts[0].kind == "max_turns" and contexts[0].agent == "looper"

    refusing = Agent(
        "geo", "Answer.", provider=_provider(server), output_type=City,
        error_handlers={"refusal": lambda ctx: {"name": "unknown", "population": 0}},
    )  # fmt: skip
    server.enqueue(Reply(content=None, message_extra={"refusal": "No."}))
    handled = refusing("?")
    assert handled.output == City(name="unknown", population=0)
    assert handled.metadata["handled_error"] == "refusal"

    def fallback(ctx: AgentErrorContext) -> City:
        assert isinstance(ctx.error, StructuredOutputError)
        return City(name="fallback", population=1)

    invalid = Agent(
        "geo", "Answer.", provider=_provider(server), output_type=City, output_retries=0,
        error_handlers={"invalid_output": fallback},
    )  # fmt: skip
    server.enqueue(Reply.text("not JSON at all"))
    assert invalid("?").output == City(name="fallback", population=1)


def test_output_configuration_errors(server: FakeOpenAIServer) -> None:
    provider = _provider(server)
    with pytest.raises(ConfigurationError, match="error_handlers has no kind"):
        Agent("x", provider=provider, error_handlers={"timeout": lambda c: ""})
    with pytest.raises(ConfigurationError, match=r"\(output\) or"):
        Agent("x", provider=provider, output_validators=[lambda: None])

    def three(a: Any, b: Any, c: Any) -> None:
        return None

    with pytest.raises(ConfigurationError, match="three"):
        Agent("x", provider=provider, output_validators=[three])


class Town(BaseModel):
    name: str


def test_bad_output_retries_and_a_handler_returning_the_wrong_type_are_clear_errors() -> None:
    from treadle.testing.scripted import ScriptedExecutor

    for bad in (-1, True, 2.5):
        with pytest.raises(ConfigurationError, match="output_retries must be an int >= 0"):
            Agent("a", "t", output_retries=bad, executor=ScriptedExecutor(default="x"))  # type: ignore[arg-type]

    def wrong_answer(ctx: AgentErrorContext) -> int:
        return 42

    def refuse(output: Any) -> Any:
        raise ModelRetry("again")

    agent = Agent(
        "a",
        "t",
        output_type=Town,
        output_validators=[refuse],
        output_retries=0,
        error_handlers={"invalid_output": wrong_answer},
        executor=ScriptedExecutor(default='{"name": "x"}'),
    )
    with pytest.raises(ConfigurationError, match=r"error handler .*wrong_answer.* returned int"):
        agent("q").synchronize(120)
