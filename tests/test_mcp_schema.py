"""Server schemas compiled for bounded-time checks: RE2 for regexes, refused `$ref` loops and
outside refs, recursive schemas that descend accepted, deep arguments a tool error."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

pytest.importorskip("mcp")

import mcp_types as types

from treadle.errors import MCPSchemaError, ToolArgumentsError
from treadle.mcp import MCPTool
from treadle.mcp.schema import SchemaRefused, compile_schema
from treadle.runtime import get_runtime


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
    # Too large to check on the loop: `validate` leaves it, `invoke` checks it on a worker.
    assert tool.validate(value) == value
    with pytest.raises(ToolArgumentsError, match="nested too deeply"):
        get_runtime().run(tool.invoke(value, context=None))  # type: ignore[arg-type]


def test_an_unusable_output_schema_is_refused_too() -> None:
    from treadle.mcp.listing import compile_all

    fine = types.Tool(name="ok", input_schema={"type": "object"})
    looping = types.Tool(
        name="loop", input_schema={"type": "object"}, output_schema={"type": "object", "$ref": "#"}
    )
    assert compile_all((fine,), "demo-server")[0][1] is None
    with pytest.raises(MCPSchemaError, match="tool 'loop' with an output schema Treadle refuses"):
        compile_all((fine, looping), "demo-server")


def _dag(levels: int) -> dict[str, Any]:
    """N levels of `anyOf`, each with two `$ref`s to the next: no loop, 2**N subschemas."""
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "integer"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def test_refs_that_fan_out_without_a_loop_are_refused_when_counted_over_the_cap() -> None:
    validator = compile_schema(_dag(6))  # 3 * 2**6 subschemas: fine
    assert list(validator.iter_errors({"x": 1})) == []
    with pytest.raises(SchemaRefused, match=r"fan out .* over 1,000 subschemas"):
        compile_schema(_dag(14))  # 2**14 subschemas for every value of x

    class Server:
        label = "demo-server"

        async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
            raise AssertionError("never called")

    with pytest.raises(MCPSchemaError, match=r"lists tool 'deep' .* fan out"):
        MCPTool(Server(), types.Tool(name="deep", input_schema=_dag(14)))


def test_unique_items_is_checked_by_hashing_not_pairwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import jsonschema._utils  # type: ignore[import-untyped]

    compared = 0
    real_equal = jsonschema._utils.equal

    def counting(one: Any, two: Any) -> bool:
        nonlocal compared
        compared += 1
        return bool(real_equal(one, two))

    monkeypatch.setattr(jsonschema._utils, "equal", counting)
    validator = compile_schema({"type": "array", "uniqueItems": True})
    assert list(validator.iter_errors([{"k": i} for i in range(2000)])) == []
    assert compared < 2000  # pairwise would be about 2,000,000 comparisons
    # JSON Schema's equality: 1 == 1.0, key order ignored, true != 1
    assert list(validator.iter_errors([1, 1.0]))
    assert list(validator.iter_errors([{"a": 1, "b": [2]}, {"b": [2.0], "a": 1}]))
    assert not list(validator.iter_errors([1, True]))
    assert not list(validator.iter_errors([[0], [False], {"a": None}, {"a": 0}]))


def test_a_string_past_the_pattern_limit_is_refused_naming_it() -> None:
    # one RE2 call is linear in the string but may cost pattern-size steps per character
    # (900,000 characters against `a[ab]{1000}...` ran 53 s): the string's length is capped
    from treadle.mcp.schema import MAX_PATTERN_CHARACTERS

    compiled = compile_schema({"type": "string", "pattern": "^a+$"})
    assert compiled.errors("a" * MAX_PATTERN_CHARACTERS, 2.0) == []
    (error,) = compiled.errors("a" * (MAX_PATTERN_CHARACTERS + 1), 2.0)
    assert f"{MAX_PATTERN_CHARACTERS:,}-character limit" in error.message


@pytest.mark.parametrize(
    ("schema", "heavy"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}}, False),
        ({"enum": ["a", "b", "c"]}, False),
        (
            {
                "properties": {"a": {"$ref": "#/$defs/e"}},
                "$defs": {"e": {"enum": list(range(999))}},
            },
            True,
        ),
        ({"properties": {"a": {"const": {"k": list(range(100))}}}}, True),
        ({"properties": {"a": {"type": "string", "pattern": "^a"}}}, True),
        ({"patternProperties": {"^a": {}}}, True),
    ],
)
def test_a_schema_with_a_pattern_or_a_big_enum_is_checked_off_the_loop(
    schema: dict[str, Any], heavy: bool
) -> None:
    # a cheap-scored schema whose enum has 16,000 entries held the loop 560-700 ms a check
    assert compile_schema(schema).heavy is heavy


def test_a_check_past_its_budget_fails_and_starves_nothing_else() -> None:
    # a check is stopped waiting for at its budget (one RE2 call cannot be interrupted); checks
    # run on threads of their own, so runaway ones leave the runtime's internal I/O threads free
    import time

    from treadle.mcp.schema import BudgetExceeded, run_check
    from treadle.runtime.threads import run_internal_io

    async def go() -> tuple[int, float, float]:
        runaway = [asyncio.ensure_future(run_check(time.sleep, 3, budget=0.3)) for _ in range(16)]
        started = time.monotonic()
        other = await run_internal_io(lambda: 42)
        other_took = time.monotonic() - started
        results = await asyncio.gather(*runaway, return_exceptions=True)
        assert all(isinstance(r, BudgetExceeded) for r in results), results
        return other, other_took, time.monotonic() - started

    other, other_took, all_took = get_runtime().run(go())
    assert other == 42
    assert other_took < all_took  # answered before the runaway checks were given up on
