"""Schemas, docstrings and argument validation of `@tool` and `BaseTool`."""

from __future__ import annotations

import enum
import json
from typing import Any, Literal

import pydantic
import pytest

from treadle.errors import ConfigurationError, ToolArgumentsError
from treadle.sandbox import Sandbox, global_system_tools
from treadle.session import Session
from treadle.tools import BaseTool, FunctionTool, Tool, ToolSet, tool
from treadle.tools.docstrings import parse_docstring


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(pydantic.BaseModel):
    x: int
    y: int = 0


def params(t: Tool) -> dict[str, Any]:
    return t.schema()["function"]["parameters"]


def test_bare_decorator_builds_openai_schema() -> None:
    @tool
    def greet(name: str, excited: bool = False) -> str:
        """Greet someone.

        Args:
            name: Who to greet.
            excited: Add an exclamation mark.
        """
        return f"hi {name}{'!' if excited else ''}"

    assert isinstance(greet, FunctionTool)
    schema = greet.schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "greet"
    assert fn["description"] == "Greet someone."
    p = fn["parameters"]
    assert p["type"] == "object"
    assert p["required"] == ["name"]
    assert p["properties"]["name"] == {"type": "string", "description": "Who to greet."}
    assert p["properties"]["excited"]["default"] is False
    assert p["additionalProperties"] is False
    assert "title" not in p
    assert json.loads(greet.schema_json()) == schema
    assert greet.schema_json() is greet.schema_json()  # encoded once
    assert greet("bob", excited=True) == "hi bob!"  # still callable as the function


@pytest.mark.parametrize(
    ("annotation", "check"),
    [
        (int, lambda s: s["type"] == "integer"),
        (float, lambda s: s["type"] == "number"),
        (list[str], lambda s: s == {"type": "array", "items": {"type": "string"}}),
        (dict[str, int], lambda s: s["type"] == "object"),
        (Literal["a", "b"], lambda s: s["enum"] == ["a", "b"]),
        (int | None, lambda s: {"type": "null"} in s["anyOf"]),
        (Colour, lambda s: "$ref" in s),
        (Point, lambda s: "$ref" in s),
        (list[Point], lambda s: s["items"]["$ref"].endswith("Point")),
    ],
)
def test_schema_for_each_supported_type(annotation: Any, check: Any) -> None:
    def fn(value: Any) -> None:
        """Takes a value."""

    fn.__annotations__ = {"value": annotation}
    t = tool(fn)
    assert check(params(t)["properties"]["value"])
    if annotation in (Colour, Point, list[Point]):
        defs = params(t)["$defs"]
        assert set(defs) & {"Colour", "Point"}


def test_validation_converts_nested_models_and_enums() -> None:
    @tool
    def place(points: list[Point], colour: Colour, label: str | None = None) -> int:
        """Place points."""
        return len(points)

    args = place.validate({"points": [{"x": 1}, {"x": 2, "y": 3}], "colour": "red"})
    assert args["points"] == [Point(x=1), Point(x=2, y=3)]
    assert args["colour"] is Colour.RED
    assert args["label"] is None


def test_validation_error_names_field_paths() -> None:
    @tool
    def place(points: list[Point], colour: Colour) -> None:
        """Place points."""

    with pytest.raises(ToolArgumentsError) as info:
        place.validate({"points": [{"x": 1}, {"y": 2}], "colour": "green", "extra": 1})
    message = info.value.message
    assert "points.1.x: Field required" in message
    assert "colour:" in message
    assert "extra: Extra inputs are not permitted" in message
    assert info.value.error_kind == "invalid_tool_arguments"


def test_kwargs_allows_extra_and_reserved_names_work() -> None:
    @tool
    def f(json: str, copy: int = 1, **rest: Any) -> dict[str, Any]:
        """Names that clash with BaseModel attributes."""
        return {"json": json, "copy": copy, **rest}

    assert params(f)["additionalProperties"] is True
    assert f.validate({"json": "x", "more": 2}) == {"json": "x", "copy": 1, "more": 2}


@pytest.mark.parametrize(
    "doc",
    [
        """Sum two numbers.

        Args:
            a (int): The first
                number.
            b: The second number.

        Returns:
            The sum.
        """,
        """Sum two numbers.

        :param int a: The first
            number.
        :param b: The second number.
        :returns: The sum.
        """,
        """Sum two numbers.

        Parameters
        ----------
        a : int
            The first
            number.
        b : int
            The second number.

        Returns
        -------
        int
        """,
    ],
    ids=["google", "sphinx", "numpy"],
)
def test_docstring_styles(doc: str) -> None:
    parsed = parse_docstring(doc)
    assert parsed.summary == "Sum two numbers."
    assert parsed.params == {"a": "The first number.", "b": "The second number."}


def test_docstring_without_sections_and_empty() -> None:
    assert parse_docstring(None).summary == ""
    assert parse_docstring("Just text.\n\nMore.").summary == "Just text.\n\nMore."


def test_session_and_sandbox_parameters_are_injected_not_shown() -> None:
    @tool
    async def probe(session: Session, sandbox: Sandbox | None, query: str) -> str:
        """Probe."""
        return query

    assert dict(probe.injected) == {"session": "session", "sandbox": "sandbox"}
    assert list(params(probe)["properties"]) == ["query"]


def test_options_are_stored_and_checked() -> None:
    @tool(name="renamed", timeout=2, parallel_safe=False, max_result_chars=10,
          needs_approval=True, idempotent=True, description="Custom.")  # fmt: skip
    def f() -> None:
        """Original."""

    assert (f.name, f.description, f.timeout, f.parallel_safe) == ("renamed", "Custom.", 2, False)
    assert (f.max_result_chars, f.needs_approval, f.idempotent) == (10, True, True)
    assert params(f)["properties"] == {}
    with pytest.raises(ConfigurationError):
        tool(name="has space")(lambda: None)
    with pytest.raises(ConfigurationError):
        tool(timeout=0)(lambda: None)

    def positional(a: int, /) -> None: ...

    with pytest.raises(ConfigurationError):
        tool(positional)


class Opaque:
    pass


def test_unschemable_or_unresolvable_type_is_a_configuration_error() -> None:
    def f(x: Opaque) -> None: ...

    with pytest.raises(ConfigurationError, match="no JSON schema"):
        tool(f)

    def g(x: NotDefinedAnywhere) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(ConfigurationError, match="cannot resolve the type hint"):
        tool(g)


class Weather(BaseTool):
    name = "weather"
    description = "Current weather in a city."
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    }

    async def __call__(self, city: str, days: int = 1) -> dict[str, Any]:
        return {"city": city, "days": days}


def test_base_tool_schema_and_light_validation() -> None:
    w = Weather()
    assert w.schema()["function"]["parameters"] is Weather.parameters
    assert w.validate({"city": "Oslo"}) == {"city": "Oslo"}
    with pytest.raises(ToolArgumentsError) as info:
        w.validate({"days": True, "x": 1})
    assert "city: Field required" in info.value.message
    assert "days: Input should be of type integer" in info.value.message
    assert "x: Extra inputs are not permitted" in info.value.message


def test_base_tool_requires_name() -> None:
    class Nameless(BaseTool):
        def __call__(self, **arguments: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="name"):
        Nameless()


def test_toolset_build_and_name_clashes() -> None:
    def lookup(key: str) -> str:
        """Look up a key."""
        return key

    ts = ToolSet.build([lookup, Weather])
    assert ts.names == ["lookup", "weather"]
    assert "lookup" in ts and len(ts) == 2 and isinstance(ts["weather"], Weather)
    body = ts.schemas_json()
    assert body is not None and body is ts.schemas_json()
    assert [s["function"]["name"] for s in json.loads(body)] == ["lookup", "weather"]
    assert ToolSet.build(None).schemas_json() is None
    with_builtins = ToolSet.build([lookup], builtins=global_system_tools())
    assert {"run_shell_command", "write_workspace_file", "read_workspace_file",
            "list_workspace_files", "lookup"} == set(with_builtins.names)  # fmt: skip
    with pytest.raises(ConfigurationError, match="shadows a built-in"):
        ToolSet.build([tool(name="run_shell_command")(lookup)], builtins=global_system_tools())
    with pytest.raises(ConfigurationError, match="two tools are named"):
        ToolSet.build([lookup, tool(lookup)])
