"""Where a function tool's schema comes from: pydantic `Field`s, `Annotated`, callable objects.

Re-expressed from the OpenAI Agents SDK's function-schema tests. Before the fix: a `Field(...)`
default lost its description and constraints, made the parameter optional and reached the
function as a raw `FieldInfo`; `Annotated[T, Field(description=...)]` lost the description; a
callable object's `__call__` docstring was ignored and its class annotations replaced the
parameter types. Schemas are checked as sent over HTTP to the fake server, and validation by
calls the fake model makes.
"""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Annotated, Any

import pydantic
import pytest
from pydantic import Field

from treadle import Provider, Session, run_session_loop, tool
from treadle.errors import ConfigurationError
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply
from treadle.tools import FunctionTool


def _run(server: FakeOpenAIServer, tools: list[Any], *replies: Reply) -> Session:
    server.enqueue(*replies, Reply.text("done"))
    return run_session_loop(
        Session.from_user_message("go"),
        Session.from_agent_prompt("Use the tools."),
        agent_provider=Provider(model="m", base_url=server.base_url, api_key="k"),
        tools=tools,
    ).synchronize()


def _sent(server: FakeOpenAIServer, name: str) -> dict[str, Any]:
    for spec in server.requests[0].body["tools"]:
        if spec["function"]["name"] == name:
            return spec["function"]  # type: ignore[no-any-return]
    raise AssertionError(f"{name} was not sent")


def _result(out: Session, index: int = 0) -> dict[str, Any]:
    rows = [r for r in out.rows if r.kind == "tool_result"]
    return json.loads(rows[index].payload["content"])  # type: ignore[no-any-return]


@tool
def take(count: int = Field(gt=0, description="How many to take."), label: str = "x") -> str:
    """Take some."""
    return f"{label}{count}"


def test_a_field_default_carries_description_constraints_and_required(
    server: FakeOpenAIServer,
) -> None:
    out = _run(
        server,
        [take],
        Reply.tool_call("take", {}),
        Reply.tool_call("take", {"count": 0}),
        Reply.tool_call("take", {"count": 3}),
    )
    sent = _sent(server, "take")["parameters"]
    assert sent["properties"]["count"] == {
        "description": "How many to take.",
        "exclusiveMinimum": 0,
        "type": "integer",
    }
    assert sent["required"] == ["count"]
    missing, too_small, ok = _result(out, 0), _result(out, 1), _result(out, 2)
    assert missing["error_kind"] == "invalid_tool_arguments" and "count" in missing["message"]
    assert too_small["error_kind"] == "invalid_tool_arguments"
    assert "greater than 0" in too_small["message"]
    assert ok == {"ok": True, "result": "x3"}  # the function got an int, never a FieldInfo


def test_a_field_default_with_a_value_is_optional() -> None:
    @tool
    def page(size: int = Field(10, le=100, description="Rows per page.")) -> int:
        """Page."""
        return size

    assert page.parameters["properties"]["size"]["default"] == 10
    assert "required" not in page.parameters
    assert page.validate({}) == {"size": 10}


def test_annotated_field_and_annotated_text_describe_a_parameter() -> None:
    @tool
    def find(
        query: Annotated[str, Field(description="What to look for.", min_length=2)],
        limit: Annotated[int, "At most this many hits."] = 5,
        where: str = "all",
    ) -> list[str]:
        """Find things.

        Args:
            query: overridden by the Field's description.
            where: Which shelf.
        """
        return [query] * limit

    props = find.parameters["properties"]
    assert props["query"] == {"description": "What to look for.", "minLength": 2, "type": "string"}
    assert props["limit"]["description"] == "At most this many hits."
    assert props["where"]["description"] == "Which shelf."
    assert find.parameters["required"] == ["query"]


class Scaler:
    """The class docstring (not what the model should see)."""

    factor: str = "a class attribute, not a parameter type"

    def __init__(self, factor: int) -> None:
        self.factor = str(factor)

    def __call__(self, value: int, unit: Unit = "m") -> str:
        """Scale a value.

        Args:
            value: The value to scale.
            unit: The unit of the value.
        """
        return f"{value * int(self.factor)}{unit}"

    def halve(self, value: int) -> float:
        """Halve a value."""
        return value / 2


Unit = str  # resolved in this module after the class body, as string annotations are


def test_a_callable_object_uses_its_call_signature_and_docstring(
    server: FakeOpenAIServer,
) -> None:
    scale = FunctionTool(Scaler(3), name="scale")
    assert scale.description == "Scale a value."
    props = scale.parameters["properties"]
    assert props["value"] == {"description": "The value to scale.", "type": "integer"}
    assert props["unit"]["type"] == "string"
    out = _run(server, [scale], Reply.tool_call("scale", {"value": "4"}))
    assert _result(out) == {"ok": True, "result": "12m"}  # lax mode: "4" became 4


def test_a_bound_method_is_a_tool() -> None:
    halve = tool(Scaler(1).halve)
    assert halve.name == "halve" and halve.description == "Halve a value."
    assert halve.parameters["properties"]["value"] == {"type": "integer"}
    assert halve(4) == 2.0


def test_star_args_and_positional_only_are_refused_clearly() -> None:
    def spread(*values: int) -> int:
        return sum(values)

    with pytest.raises(ConfigurationError, match=r"\*values is not supported.*named arguments"):
        tool(spread)

    def positional(a: int, /) -> int:
        return a

    with pytest.raises(ConfigurationError, match="positional-only"):
        tool(positional)


class Point(pydantic.BaseModel):
    x: int
    y: int


def test_a_tool_is_strict_by_default_where_its_schema_allows(server: FakeOpenAIServer) -> None:
    @tool
    def move(to: Point, why: str) -> str:
        """Move."""
        return why

    @tool(strict=True)
    def shift(dx: int, dy: int = 0) -> int:
        """Shift; strict=True makes dy required too."""
        return dx + dy

    out = _run(server, [move, take, shift], Reply.tool_call("shift", {"dx": 1, "dy": 2}))
    sent_move = _sent(server, "move")
    assert sent_move["strict"] is True
    assert sent_move["parameters"]["additionalProperties"] is False
    assert sent_move["parameters"]["$defs"]["Point"]["additionalProperties"] is False
    assert sent_move["parameters"]["$defs"]["Point"]["required"] == ["x", "y"]
    assert "strict" not in _sent(server, "take")  # an optional parameter: not strict by default
    sent_shift = _sent(server, "shift")
    assert sent_shift["strict"] is True and sent_shift["parameters"]["required"] == ["dx", "dy"]
    assert "default" not in sent_shift["parameters"]["properties"]["dy"]
    assert _result(out) == {"ok": True, "result": 3}


def test_strict_true_where_a_schema_cannot_be_strict_is_a_clear_error() -> None:
    def tally(counts: dict[str, int]) -> int:
        return sum(counts.values())

    assert "strict" not in tool(tally).schema()["function"]  # auto: quietly not strict
    with pytest.raises(ConfigurationError, match="cannot be strict: counts is an object"):
        tool(strict=True)(tally)

    def anything(**options: Any) -> int:
        return len(options)

    with pytest.raises(ConfigurationError, match="cannot be strict"):
        tool(strict=True)(anything)
    assert "strict" not in tool(strict=False)(Scaler(1).halve).schema()["function"]


def test_keywords_strict_mode_does_not_support_keep_a_tool_loose() -> None:
    def name_it(name: Annotated[str, Field(min_length=2)]) -> str:
        return name

    assert "strict" not in tool(name_it).schema()["function"]
    with pytest.raises(ConfigurationError, match="name uses minLength, which strict mode"):
        tool(strict=True)(name_it)


class _Loose(pydantic.BaseModel):
    """A model with a typeless field, reached through `$defs`."""

    anything: Any


def _any_value(x: Any) -> str:
    return "ok"


def _an_object(x: object) -> str:
    return "ok"


def _a_bare_list(x: list) -> str:  # type: ignore[type-arg]
    return "ok"


def _a_nested_any(x: _Loose) -> str:
    return "ok"


@pytest.mark.parametrize(
    "fn", [_any_value, _an_object, _a_bare_list, _a_nested_any], ids=lambda f: f.__name__
)
def test_a_typeless_parameter_keeps_a_tool_loose(server: FakeOpenAIServer, fn: Any) -> None:
    # OpenAI refuses a node without a type in strict mode ("schema must have a 'type' key").
    loose = tool(fn)
    server.enqueue(Reply.text("done"))
    out = run_session_loop(
        Session.from_user_message("go"), Session.from_agent_prompt("Use tools."),
        agent_provider=Provider(model="m", base_url=server.base_url, api_key="k"),
        tools=[loose],
    )  # fmt: skip
    assert out.final_text == "done"
    assert "strict" not in _sent(server, fn.__name__)
    no_type = r"cannot be strict: (x|_Loose\.anything) has no type"
    with pytest.raises(ConfigurationError, match=no_type):
        tool(strict=True)(fn)


def test_formats_outside_strict_modes_subset_keep_a_tool_loose() -> None:
    def upload(data: bytes) -> int:  # bytes: {"format": "binary"}
        return len(data)

    def stamp(at: datetime.datetime, who: uuid.UUID) -> str:  # date-time, uuid: supported
        return f"{who} {at}"

    assert "strict" not in tool(upload).schema()["function"]
    with pytest.raises(ConfigurationError, match="data uses format 'binary'"):
        tool(strict=True)(upload)
    assert tool(stamp).schema()["function"]["strict"] is True
