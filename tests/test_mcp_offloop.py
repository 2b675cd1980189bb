"""Peer-controlled MCP work that costs seconds of pure Python runs off the runtime loop: parsing a
message near the size cap (tens of thousands of content blocks), and checking large arguments or
arguments against an expensive schema, which also has a time budget that fails the call (never
the pass) when it runs out.

Stalls are measured and printed (`-s`), not asserted: what is asserted is which thread did the
work.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import mcp_types as types
import pytest

pytest.importorskip("mcp")

from loop_watch import watch_loop
from mcp_helpers import GUARD_SECONDS, SERVER_SCRIPT, calls_then_answer, tool_results
from treadle import Session
from treadle.errors import MCPSchemaError
from treadle.llm import Provider
from treadle.loop import run_session_loop
from treadle.mcp import MCPServer, MCPTool
from treadle.mcp import listing as listing_module
from treadle.mcp import stdio as stdio_module
from treadle.mcp import tool as tool_module
from treadle.mcp.schema import Compiled
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use the tools.")


def test_a_message_of_many_blocks_is_parsed_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed_on_loop: list[tuple[int, bool]] = []
    real_parse = stdio_module._parse

    def watched(line: bytes, label: str) -> Any:  # the real parser, noting where it ran
        parsed_on_loop.append((len(line), get_runtime().in_loop_thread()))
        return real_parse(line, label)

    monkeypatch.setattr(stdio_module, "_parse", watched)
    typed_on_loop: list[bool] = []
    real_typed = listing_module._typed

    def watched_typing(*args: Any) -> Any:  # the SDK's typing of the result, noted likewise
        typed_on_loop.append(get_runtime().in_loop_thread())
        return real_typed(*args)

    monkeypatch.setattr(listing_module, "_typed", watched_typing)
    server = MCPServer.stdio(sys.executable, [SERVER_SCRIPT], stderr=subprocess.DEVNULL)
    try:
        server.tools()
        with watch_loop() as stall:
            result = get_runtime().run(
                server.call("blocks", {"count": 5_000}), timeout=GUARD_SECONDS
            )
        assert len(result.content) == 5_000
    finally:
        server.close()
    big = [on_loop for size, on_loop in parsed_on_loop if size > stdio_module.PARSE_OFF_LOOP_BYTES]
    small = [on_loop for size, on_loop in parsed_on_loop if size <= 1024]
    assert big == [False]  # the one large message: parsed on a worker thread (and typed there)
    assert small and all(small)  # small ones stay on the loop (cheaper than a hand-over)
    assert typed_on_loop == [False]  # the SDK's typing of its 5,000 blocks: on a worker too
    print(f"5,000 blocks: {stall}")


class _Server:
    """The server side of an `MCPTool` (a stand-in: these tests are about the check made before
    any request, and count the requests that reach it)."""

    label = "demo-server"

    def __init__(self) -> None:
        self.calls = 0

    async def call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        self.calls += 1
        return types.CallToolResult(content=[types.TextContent(type="text", text="done")])


def _fan_out(levels: int) -> dict[str, Any]:
    """A schema whose `$ref`s fan out: each level is `anyOf` two refs to the next (no loop), so
    one item is checked against about 2**levels subschemas."""
    defs: dict[str, Any] = {f"l{levels}": {"type": "integer"}}
    for level in range(levels):
        nxt = {"$ref": f"#/$defs/l{level + 1}"}
        defs[f"l{level}"] = {"anyOf": [nxt, dict(nxt)]}
    return {
        "type": "object",
        "$defs": defs,
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/l0"}}},
    }


def _pass(tool: MCPTool, arguments: dict[str, Any]) -> dict[str, Any]:
    with FakeOpenAIServer(script=calls_then_answer((tool.name, arguments))) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=[tool]
        )
        out.synchronize(timeout=GUARD_SECONDS)
    assert out.stop_reason == "final_answer"  # the pass itself went on
    return tool_results(out.rows)[tool.name]


def test_a_check_past_its_budget_fails_the_call_not_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A budget far under what 5,000 items x ~500 subschemas take on any machine.
    monkeypatch.setattr(tool_module, "CHECK_BUDGET_SECONDS", 0.001)
    server = _Server()
    tool = MCPTool(server, types.Tool(name="fan", input_schema=_fan_out(6)))
    assert tool._validator.cost > tool_module.CHEAP_SCHEMA_COST
    result = _pass(tool, {"items": list(range(5000))})
    assert result["ok"] is False
    assert "checking the arguments for tool 'fan'" in result["message"]
    assert "MCP server demo-server" in result["message"]
    assert "took over 0.001 s" in result["message"]
    assert server.calls == 0


def test_large_arguments_are_checked_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[bool] = []
    real_errors = Compiled.errors

    def watched(self: Compiled, instance: Any, budget: float) -> list[Any]:
        threads.append(get_runtime().in_loop_thread())
        return real_errors(self, instance, budget)

    monkeypatch.setattr(Compiled, "errors", watched)
    # The budget is wall time from the check's submission (queue and thread start included):
    # one loaded fresh-clone run stalled past 2 s and the wrong argument came back as the
    # overrun's `tool_execution_exception`. This test is about where checks run; the budget
    # has its own test above.
    monkeypatch.setattr(tool_module, "CHECK_BUDGET_SECONDS", GUARD_SECONDS)
    server = _Server()
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {}}}}
    tool = MCPTool(server, types.Tool(name="bulk", input_schema=schema))
    assert _pass(tool, {"items": [1, 2]})["ok"] is True  # small and cheap: on the loop
    assert _pass(tool, {"items": list(range(5000))})["ok"] is True  # large: on a worker
    bad = _pass(tool, {"items": "not a list" * 10_000})  # large and wrong: still refused
    assert bad["ok"] is False and bad["error_kind"] == "invalid_tool_arguments", bad
    assert threads == [True, False, False]
    assert server.calls == 2


def test_a_ref_loop_behind_an_embedded_id_is_refused() -> None:
    # Inside the resource `http://e/x`, `#` is that resource, not the document's root: the loop
    # x -> allOf/0 -> x never descends, and jsonschema would recurse until RecursionError.
    schema = {
        "$id": "http://e/root",
        "type": "object",
        "$defs": {"x": {"$id": "http://e/x", "allOf": [{"$ref": "#"}]}},
        "properties": {"a": {"$ref": "#/$defs/x"}},
    }
    with pytest.raises(MCPSchemaError, match=r"lists tool 'hidden'.*loops without descending"):
        MCPTool(_Server(), types.Tool(name="hidden", input_schema=schema))
    relative = {
        "type": "object",
        "$defs": {"y": {"$id": "y.json", "anyOf": [{"$ref": "y.json"}]}},
        "properties": {"a": {"$ref": "#/$defs/y"}},
    }
    with pytest.raises(MCPSchemaError, match="loops without descending"):
        MCPTool(_Server(), types.Tool(name="relative", input_schema=relative))
    # A ref to an embedded resource that does descend is fine, and checks as jsonschema does.
    fine = {
        "type": "object",
        "$defs": {"node": {"$id": "http://e/node", "type": "array", "items": {"$ref": "#"}}},
        "properties": {"tree": {"$ref": "http://e/node"}},
    }
    tool = MCPTool(_Server(), types.Tool(name="tree", input_schema=fine))
    assert tool.validate({"tree": [[], [[]]]}) == {"tree": [[], [[]]]}
    with pytest.raises(Exception, match="is not of type 'array'"):
        tool.validate({"tree": [[], [1]]})


def test_a_bulky_listing_is_typed_in_steps_as_the_sdk_types_it() -> None:
    # 600 tools: over OFF_LOOP_ITEMS, so typed on a worker in steps; the result must equal what
    # the SDK's own one-call typing gives.
    raw = {
        "tools": [
            {"name": f"t{i}", "inputSchema": {"type": "object"}, "description": f"tool {i}"}
            for i in range(600)
        ],
        "nextCursor": "more",
    }
    assert len(raw["tools"]) > listing_module.OFF_LOOP_ITEMS
    stepped = listing_module._typed(None, "tools/list", raw, types.ListToolsResult)
    whole = types.ListToolsResult.model_validate(raw, by_name=False)
    assert stepped == whole and stepped.next_cursor == "more"
