"""MCP replies just under the message-size cap, beside 100 bystander passes.

A reply the cap admits may still be costly: 1 MiB of tiny JSON values is some 100,000 Python
objects to parse, type, check against an output schema and turn into the capped text the model
reads. Each case runs beside tests/test_isolation.py's bystanders, whose transcripts must come
out as in a quiet run while the runtime loop thread spends under `STALL_LIMIT` of CPU time
between two heartbeats (tests/loop_watch.py); the other forms of stall (the GIL held by a worker
thread's long C call, a full garbage collection) are printed and in docs/mcp.md. Over stdio
(Treadle's reader) and streamable HTTP (the SDK's, JSON replies and server-sent events), for a
tool result and for a tool list. Every test ends with no server process left.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from loop_watch import STALL_LIMIT, beside_bystanders, quiet_transcripts
from mcp_helpers import GUARD_SECONDS, http_server, server_children, tool_pass
from treadle import Session
from treadle.errors import MCPServerError
from treadle.mcp import MCPServer
from treadle.mcp.listing import MAX_LISTED_TOOLS
from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES
from treadle.tools.results import MAX_CONTENT_CHARS

AGENT = Session.from_agent_prompt("Use the tools.")
RAW_SERVER = str(Path(__file__).with_name("mcp_raw_server.py"))
CAP = DEFAULT_MAX_MESSAGE_BYTES
# One text block of the SDK server's `blocks` tool on the wire: `{"type":"text","text":"b"},`
BLOCK_BYTES = 27


def _raw(*extra: str) -> MCPServer:
    return MCPServer.stdio(sys.executable, [RAW_SERVER, *extra], stderr=subprocess.DEVNULL)


_pass = tool_pass  # one pass calling one tool


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    # The one-time imports of a first connection of each kind are no part of what is measured.
    warm = _raw()
    try:
        _pass(warm, "go", {"kind": "ok"})
    finally:
        warm.close()
    with http_server() as url:
        remote = MCPServer.http(url)
        try:
            _pass(remote, "blocks", {"count": 2})
        finally:
            remote.close()
    return quiet_transcripts()


@pytest.fixture
def raw() -> Iterator[MCPServer]:
    server = _raw("--output-schema")
    server.tools()
    yield server
    server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


@pytest.mark.parametrize("kind", ["fill_structured", "fill_blocks"])
def test_a_stdio_reply_just_under_the_cap_costs_the_loop_nothing(
    kind: str, quiet: list[list[dict[str, Any]]]
) -> None:
    server = _raw()
    try:
        arguments = {"kind": kind, "size": CAP}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        assert body["ok"] is True, body
        # the model reads the capped text only (here cut whole: far too many entries)
        text = body.get("result") or body.get("content") or ""
        assert ("structured" if kind == "fill_structured" else "t\nt\nt") in text, body
        assert len(text) <= MAX_CONTENT_CHARS and "[truncated " in text
        assert server.restarts == 0  # admitted by the cap: no fault
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_near_cap_result_against_an_output_schema_fails_its_call_only(
    raw: MCPServer, quiet: list[list[dict[str, Any]]]
) -> None:
    # ~100,000 entries checked by jsonschema (pure Python): on a worker thread, under a budget
    arguments = {"kind": "fill_structured", "size": CAP}
    body, stall = beside_bystanders(lambda: _pass(raw, "go", arguments), quiet)
    assert body["ok"] is False and body["error_kind"] == "tool_execution_exception"
    message = body["message"]
    assert "9 is greater than the maximum of 8" in message or "took over" in message, message
    assert stall.cpu < STALL_LIMIT, stall
    assert raw.restarts == 0  # the call failed, not the connection


@pytest.mark.parametrize("shape", ["sse", "json"])
def test_an_http_reply_just_under_the_cap_costs_the_loop_nothing(
    shape: str, quiet: list[list[dict[str, Any]]]
) -> None:
    extra = ("--json",) if shape == "json" else ()
    count = (CAP - 1024) // BLOCK_BYTES
    with http_server(*extra) as url:
        remote = MCPServer.http(url)
        try:
            body, stall = beside_bystanders(
                lambda: _pass(remote, "blocks", {"count": count}), quiet
            )
            assert body["ok"] is True, body
            assert body["content"].startswith("b\nb\n")
            assert remote.restarts == 0  # admitted by the cap: no fault
            assert stall.cpu < STALL_LIMIT, stall
        finally:
            remote.close()


def test_a_long_tool_list_costs_the_loop_nothing(quiet: list[list[dict[str, Any]]]) -> None:
    server = _raw("--tools", str(MAX_LISTED_TOOLS - 1))
    try:
        listed, stall = beside_bystanders(lambda: len(server.tools()), quiet)
        assert listed == MAX_LISTED_TOOLS
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_tool_list_near_the_cap_is_refused_naming_the_server(
    quiet: list[list[dict[str, Any]]],
) -> None:
    # 15,000 tools in one page of most of 1 MiB: typed off the loop, then refused before the
    # schemas are compiled (34 s of work, and every full collection slowed past a second)
    server = _raw("--tools", "15000")

    def listing() -> BaseException | None:
        try:
            server.tools()
        except MCPServerError as error:
            return error
        return None

    try:
        error, stall = beside_bystanders(listing, quiet)
        assert error is not None
        assert f"lists more than {MAX_LISTED_TOOLS:,} tools" in str(error)
        assert server.label in str(error)  # the label is cut at 80 characters: a long checkout path
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}
