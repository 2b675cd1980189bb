"""MCP replies of many tiny JSON containers, beside 100 bystander passes.

`json.loads` is one C call that holds the GIL for a whole message: just under the 1 MiB cap,
`[[[]]],[[[]]],...` (450,000 lists) held it 147 to 240 ms, every thread of the process stopped
with it, the runtime loop's included. Such a reply is refused before it is parsed (over
`MAX_MESSAGE_CONTAINERS`), one under that budget is parsed and read as any other; over stdio and
over streamable HTTP (JSON replies and server-sent events).

What is bounded here is CPU time, never a wall-clock time: the GIL hold where it happens, the
thread CPU time of each `_parse` call (`json.loads`, one C call, holds the GIL for the whole
message on the worker thread that parses it; recorded by wrapping the real `_parse` of the stdio
and HTTP transports, which still runs as it is), under `STALL_LIMIT`; and the runtime loop
thread's CPU time between two heartbeats, under `STALL_LIMIT` too, as in
tests/test_mcp_near_cap.py. The wall-clock gap less the time the OS kept threads waiting for a
CPU (`Stall.blocked`, tests/loop_watch.py) is printed (`-s`) but not asserted: on a loaded 2-core
machine it also counts time the OS ran other processes while a thread of this one held the GIL,
and it reached 119 ms for a reply whose stall took 14 ms of loop CPU (load average 40 to 60)
and 157 ms beside 17 ms (load average 10).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("mcp")

from loop_watch import beside_bystanders
from mcp_helpers import GUARD_SECONDS, http_server, server_children, tool_pass
from mcp_holds import bounded, raw_server, warm_then_quiet
from treadle import Session
from treadle.mcp import MCPServer
from treadle.mcp.parse import MAX_MESSAGE_CONTAINERS, containers
from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES

AGENT = Session.from_agent_prompt("Use the tools.")
CAP = DEFAULT_MAX_MESSAGE_BYTES
# `[[[]]]` entries (three lists each) that stay under the container budget with room to spare.
UNDER = MAX_MESSAGE_CONTAINERS // 3 - 5000


_raw = raw_server


_pass = tool_pass  # one pass calling one tool


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    return warm_then_quiet({"kind": "lists", "n": 2}, "lists")


def _refused(body: dict[str, Any], label: str) -> None:
    assert body["ok"] is False and body["error_kind"] == "tool_execution_exception", body
    assert "JSON arrays and objects" in body["message"] and label in body["message"], body


def test_a_stdio_reply_of_too_many_lists_is_refused_unparsed(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    server = _raw()
    try:
        arguments = {"kind": "fill_lists", "size": CAP}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        _refused(body, server.label)
        bounded(parse_hold, stall)
        # the connection was closed with its process; the next call starts it again
        assert _pass(server, "go", {"kind": "ok"})["ok"] is True
        assert server.restarts == 1
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_stdio_reply_under_the_container_budget_is_read(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    server = _raw()
    try:
        arguments = {"kind": "lists", "n": UNDER}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        assert body["ok"] is True, body
        assert "[[[]],[[]]" in body["result"] or "[[[]]],[[[]]]" in body["result"], body
        bounded(parse_hold, stall)
        assert server.restarts == 0
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


@pytest.mark.parametrize("shape", ["sse", "json"])
@pytest.mark.parametrize("count", [UNDER, 140_000], ids=["under", "over"])
def test_an_http_reply_of_many_lists(
    shape: str, count: int, quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    extra = ("--json",) if shape == "json" else ()
    with http_server(*extra) as url:
        remote = MCPServer.http(url)
        try:
            body, stall = beside_bystanders(lambda: _pass(remote, "lists", {"count": count}), quiet)
            if count > MAX_MESSAGE_CONTAINERS // 3:
                _refused(body, url)
            else:
                assert body["ok"] is True, body
            bounded(parse_hold, stall)
        finally:
            remote.close()


def test_brackets_inside_strings_do_not_count() -> None:
    # a text block carrying a JSON document as text: its brackets are characters, not values
    text = '[{"a": [1]}, "\\"[", "\\\\"]' * (MAX_MESSAGE_CONTAINERS // 2)
    line = json.dumps({"content": [{"type": "text", "text": text}]}).encode()
    assert line.count(b"[") > MAX_MESSAGE_CONTAINERS
    assert containers(line) == 3
    assert containers(b'{"a":"[","b":[[{}]]}', limit=0) == 4
