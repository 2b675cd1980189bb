"""Server schemas compiled for bounded-time checks: RE2 for regexes, refused `$ref` loops and
outside refs, recursive schemas that descend accepted, deep arguments a tool error."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("mcp")

import mcp_types as types

from treadle.errors import MCPSchemaError, ToolArgumentsError
from treadle.mcp import MCPTool
from treadle.mcp.schema import SchemaRefused, compile_schema


def _errors(schema: dict[str, Any], value: Any) -> list[str]:
    return [e.message for e in compile_schema(schema).iter_errors(value)]


def test_a_catastrophic_pattern_is_linear_on_re2() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}
    # 4,000 characters: Python's `re` would take longer than the universe has left
    assert _errors(schema, {"s": "a" * 4000 + "b"}) == [
        f"{'a' * 4000 + 'b'!r} does not match '^(a+)+$'"
    ]
    assert _errors(schema, {"s": "a" * 4000}) == []


def test_pattern_properties_and_additional_properties_use_re2() -> None:
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "patternProperties": {"^(x+)+_$": {"type": "string"}},
        "additionalProperties": False,
    }
    assert _errors(schema, {"id": 1, "xx_": "ok"}) == []
    assert _errors(schema, {"id": 1, "xx_": 2}) == ["2 is not of type 'string'"]
    assert _errors(schema, {"id": 1, "x" * 3000 + "y": 2}) == [
        f"Additional properties are not allowed ({'x' * 3000 + 'y'!r} was unexpected)"
    ]


def test_a_pattern_re2_cannot_express_is_left_to_the_server() -> None:
    schema = {"properties": {"t": {"type": "string", "pattern": "^(?=a)a+$"}}}
    assert _errors(schema, {"t": "bbb"}) == []


def test_recursive_schemas_that_descend_are_fine() -> None:
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/node"}, "alias": {"$ref": "#leaf"}},
        "definitions": {"leaf": {"$anchor": "leaf", "type": "string"}},
    }
    assert _errors(schema, {"root": {"kids": [{"kids": [3]}]}}) == ["3 is not of type 'object'"]
    assert _errors(schema, {"alias": 1}) == ["1 is not of type 'string'"]


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"$ref": "#"}, "loops without descending (# -> #)"),
        (
            {
                "$defs": {
                    "a": {"anyOf": [{"$ref": "#/$defs/b"}]},
                    "b": {"not": {"$ref": "#/$defs/a"}},
                }
            },
            "loops without descending",
        ),
        ({"properties": {"x": {"$ref": "https://example.com/s.json"}}}, "points outside"),
        ({"properties": {"x": {"$ref": "#/$defs/missing"}}}, "points nowhere"),
        ({"properties": {"x": {"$dynamicRef": "#meta"}}}, "$dynamicRef"),
        ({"type": 12}, "not a valid JSON Schema"),
        ({"$schema": "http://json-schema.org/draft-03/schema#"}, "dialect"),
    ],
)
def test_unusable_schemas_are_refused(schema: dict[str, Any], why: str) -> None:
    with pytest.raises(SchemaRefused, match=re.escape(why)):
        compile_schema(schema)


def test_a_refused_schema_names_tool_and_server() -> None:
    class Server:
        label = "demo-server"

        async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            raise AssertionError("never called")

    remote = types.Tool(name="loop", input_schema={"type": "object", "$ref": "#"})
    with pytest.raises(MCPSchemaError, match="MCP server demo-server lists tool 'loop'"):
        MCPTool(Server(), remote)


def test_arguments_nested_past_the_recursion_limit_are_a_tool_error() -> None:
    class Server:
        label = "demo-server"

        async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            raise AssertionError("never called")

    schema = {
        "$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}}},
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/n"}},
    }
    tool = MCPTool(Server(), types.Tool(name="deep", input_schema=schema))
    value: dict[str, Any] = {}
    for _ in range(5000):
        value = {"n": value}
    with pytest.raises(ToolArgumentsError, match="nested too deeply"):
        tool.validate(value)


def test_an_unusable_output_schema_is_refused_too() -> None:
    from treadle.mcp.listing import compile_all

    fine = types.Tool(name="ok", input_schema={"type": "object"})
    looping = types.Tool(
        name="loop", input_schema={"type": "object"}, output_schema={"type": "object", "$ref": "#"}
    )
    assert compile_all((fine,), "demo-server")[0][1] is None
    with pytest.raises(MCPSchemaError, match="tool 'loop' with an output schema Treadle refuses"):
        compile_all((fine, looping), "demo-server")
