"""MCP messages the container budget admits that still cost a long GIL hold, beside 100
bystander passes: numbers slow to parse, large notifications, results whose model text takes
the careful path.

- `json.loads` turns each number with an exponent into a float through `strtod`, up to a
  microsecond apiece for one like `1e-400`: 1 MiB of those (150,000) held the GIL 107 to 164 ms
  in one call. A message with more than `MAX_MESSAGE_EXPONENTS` is refused unparsed.
- The SDK types a notification's params on the runtime loop: 185,000 lists in the `_meta` of a
  `notifications/tools/list_changed` held the loop 465 to 731 ms. A large notification is
  slimmed where it is parsed, off the loop; the announcement still re-lists the tools.
- A tool result of plain data with one `1e999` or one string over the 20,000-character cap took
  the careful path of its model text, whose `to_jsonable_python` copied all of it in one C call
  (74 to 106 ms); plain data is now copied in Python, where the loop gets the GIL back.

As in tests/test_mcp_shapes.py, what is bounded is CPU time: the thread CPU time of every message
parse (the GIL hold of `json.loads`), of every pydantic-core call that makes the model's text
(each one C call holding the GIL), and the loop thread's CPU time between two heartbeats, each
under `STALL_LIMIT`. The wall-clock gap is printed (`-s`), not asserted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pydantic_core
import pytest

pytest.importorskip("mcp")

from loop_watch import STALL_LIMIT, beside_bystanders
from mcp_helpers import GUARD_SECONDS, http_server, server_children, tool_pass
from mcp_holds import bounded, raw_server, timed, warm_then_quiet
from treadle.mcp import MCPServer
from treadle.mcp.parse import MAX_MESSAGE_CONTAINERS
from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES
from treadle.tools import results

CAP = DEFAULT_MAX_MESSAGE_BYTES
# `[[[]]]` entries (three lists each) under the container budget with room to spare.
UNDER = MAX_MESSAGE_CONTAINERS // 3 - 5000
_pass = tool_pass


_raw = raw_server


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    return warm_then_quiet({"kind": "announce", "n": 2}, "announce")


def _refused(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float], arguments: dict[str, Any], what: str
) -> None:
    """A reply made by `arguments` is refused unparsed as `what`, naming the server, with no
    long hold; the server is restarted for the next call, and nothing of it is left."""
    server = _raw()
    try:
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        assert body["ok"] is False and body["error_kind"] == "tool_execution_exception", body
        assert what in body["message"], body
        assert server.label in body["message"], body
        bounded(parse_hold, stall)
        # the connection was closed with its process; the next call starts it again
        assert _pass(server, "go", {"kind": "ok"})["ok"] is True
        assert server.restarts == 1
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_reply_of_too_many_slow_numbers_is_refused_unparsed(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    arguments = {"kind": "fill_floats", "size": CAP}
    _refused(quiet, parse_hold, arguments, "numbers with a large exponent")


def test_a_reply_of_slow_numbers_under_the_budget_is_read(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    server = _raw()
    try:
        arguments = {"kind": "floats", "n": 20_000}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        assert body["ok"] is True and body["structured"]["x"][:2] == [0.0, 0.0], body
        bounded(parse_hold, stall)
        assert server.restarts == 0
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_reply_just_under_every_separate_budget_is_refused_by_its_total(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    # 199,806 containers, 24,997 costly exponents and 95 integers of 4,000 digits: each under
    # its own budget, together held `json.loads` 91 to 121 ms
    arguments = {"kind": "combo", "lists": 66_600, "exps": 24_990, "ints": 95}
    _refused(quiet, parse_hold, arguments, "estimated parsing")


def test_a_reply_of_mixed_shapes_under_the_total_is_read(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    server = _raw()
    try:
        arguments = {"kind": "combo", "lists": 33_000, "exps": 12_000, "ints": 40}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        # read and cut to the model's content cap, as any long result is
        assert body["ok"] is True and '"x":[[[[]]],[[[]]]' in body["result"], str(body)[:300]
        bounded(parse_hold, stall)
        assert server.restarts == 0
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def _relisted(server: MCPServer, before: int) -> bool:
    deadline = time.monotonic() + GUARD_SECONDS
    while server.listings <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.listings > before


def test_a_large_stdio_notification_is_slimmed_off_the_loop(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    server = _raw()
    try:
        server.tools()
        before = server.listings
        arguments = {"kind": "announce", "n": UNDER}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        assert body == {"ok": True, "content": "ok"}, body
        bounded(parse_hold, stall)
        assert _relisted(server, before)  # the announcement was still heard
        assert server.restarts == 0
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_large_http_notification_is_slimmed_off_the_loop(
    quiet: list[list[dict[str, Any]]], parse_hold: list[float]
) -> None:
    # on the call's own event stream (a JSON reply carries no notification)
    with http_server() as url:
        remote = MCPServer.http(url)
        try:
            remote.tools()
            before = remote.listings
            arguments = {"count": UNDER}
            body, stall = beside_bystanders(lambda: _pass(remote, "announce", arguments), quiet)
            assert body["ok"] is True and f"announced {UNDER}" in str(body), body
            bounded(parse_hold, stall)
            assert _relisted(remote, before)
        finally:
            remote.close()


@pytest.fixture
def encode_hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[float]]]:
    """The thread CPU time of every pydantic-core call that makes a tool result's model text
    (each is one C call holding the GIL), by function name."""
    held: dict[str, list[float]] = {"to_json": [], "to_jsonable_python": []}
    core = SimpleNamespace(
        to_json=timed(pydantic_core.to_json, held["to_json"]),
        to_jsonable_python=timed(pydantic_core.to_jsonable_python, held["to_jsonable_python"]),
    )
    monkeypatch.setattr(results, "pydantic_core", core)
    yield held
    longest = max(held["to_json"] + held["to_jsonable_python"])
    print(f"longest pydantic-core call {longest * 1000:.1f} ms of thread CPU")


@pytest.mark.parametrize("odd", ["inf", "long"])
def test_a_result_taking_the_careful_path_is_copied_in_steps(
    odd: str, quiet: list[list[dict[str, Any]]], encode_hold: dict[str, list[float]]
) -> None:
    server = _raw()
    try:
        arguments = {"kind": "odd", "n": 100_000, "odd": odd}
        body, stall = beside_bystanders(lambda: _pass(server, "go", arguments), quiet)
        assert body["ok"] is True and "result" in body, body  # cut to the content cap
        # the whole text as the model would read it uncut: `1e999` as "Infinity", the long
        # string cut to the 20,000-character cap
        rows = [{"k": j % 10} for j in range(100_000)]
        z = "Infinity" if odd == "inf" else "x" * 20_000 + "…[truncated 1 chars]"
        full = json.dumps(
            {"ok": True, "structured": {"rows": rows, "z": z}},
            separators=(",", ":"),
            ensure_ascii=False,
        )
        text = body["result"]
        kept = text.index("…[truncated ")
        assert text == full[:kept] + f"…[truncated {len(full) - kept} chars]", text[-200:]
        # plain data is never copied by `to_jsonable_python`, one C call for all of it
        assert encode_hold["to_jsonable_python"] == []
        longest = max(encode_hold["to_json"])
        assert longest < STALL_LIMIT, f"to_json held the GIL {longest * 1000:.1f} ms"
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}
