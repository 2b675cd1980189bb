"""Structured output in strict mode: the flag sent, the schema closed, a clear error where a
schema cannot be strict. Over HTTP against the fake server."""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
import pytest

from treadle import Agent, ConfigurationError, Provider
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply


class City(pydantic.BaseModel):
    name: str
    population: int = 0


class Census(pydantic.BaseModel):
    counts: dict[str, int]


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(model="m", base_url=server.base_url, api_key="k")


def test_tool_mode_sends_final_result_strict(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.tool_call("final_result", {"name": "Paris", "population": 2}))
    agent = Agent("geo", "Answer.", provider=_provider(server), output_type=City)
    out = agent("capital of France?")
    assert out.output == City(name="Paris", population=2)
    [spec] = server.requests[0].body["tools"]
    function = spec["function"]
    assert function["strict"] is True
    assert function["parameters"]["additionalProperties"] is False
    assert function["parameters"]["required"] == ["name", "population"]


def test_native_mode_sends_a_strict_response_format(server: FakeOpenAIServer) -> None:
    server.enqueue(Reply.text(json.dumps({"name": "Rome", "population": 3})))
    agent = Agent(
        "geo", "Answer.", provider=_provider(server), output_type=City, structured_mode="native"
    )
    assert agent("capital of Italy?").output == City(name="Rome", population=3)
    fmt = server.requests[0].body["response_format"]["json_schema"]
    assert fmt["strict"] is True and fmt["schema"]["required"] == ["name", "population"]
    assert "default" not in fmt["schema"]["properties"]["population"]


def test_a_schema_that_cannot_be_strict(server: FakeOpenAIServer) -> None:
    # Open keys (a dict field): not strict by default, a clear error when asked for.
    server.enqueue(Reply.text(json.dumps({"counts": {"a": 1}})))
    loose = Agent(
        "c", "Count.", provider=_provider(server), output_type=Census, structured_mode="native"
    )
    assert loose("count").output == Census(counts={"a": 1})
    assert server.requests[0].body["response_format"]["json_schema"]["strict"] is False
    with pytest.raises(ConfigurationError, match="output_type Census cannot be strict: counts"):
        Agent("c", "Count.", provider=_provider(server), output_type=Census, strict_output=True)
    off = Agent("c", "x", provider=_provider(server), output_type=City, strict_output=False)
    assert "strict" not in off.tools[-1].schema()["function"]


def test_tool_use_behavior_and_output_type_do_not_mix(server: FakeOpenAIServer) -> None:
    with pytest.raises(ConfigurationError, match="tool_use_behavior needs no output_type"):
        Agent(
            "c", "x", provider=_provider(server), output_type=City,
            tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip


class Loose(pydantic.BaseModel):
    answer: str
    data: Any
    items: list  # type: ignore[type-arg]


@pytest.mark.parametrize("mode", ["native", "tool"])
def test_typeless_output_fields_keep_structured_output_loose(
    server: FakeOpenAIServer, mode: Literal["native", "tool"]
) -> None:
    value = {"answer": "x", "data": 1, "items": []}
    reply = (
        Reply.text(json.dumps(value))
        if mode == "native"
        else Reply.tool_call("final_result", value)
    )
    server.enqueue(reply)
    agent = Agent("a", "Answer.", provider=_provider(server), output_type=Loose,
                  structured_mode=mode)  # fmt: skip
    assert agent("go").output == Loose(answer="x", data=1, items=[])
    body = server.requests[-1].body
    if mode == "native":
        assert body["response_format"]["json_schema"]["strict"] is False
    else:
        assert "strict" not in body["tools"][-1]["function"]
    with pytest.raises(ConfigurationError, match="output_type Loose cannot be strict: data has no"):
        Agent("a", "Answer.", provider=_provider(server), output_type=Loose, strict_output=True,
              structured_mode=mode)  # fmt: skip
