"""Each MCP server's schema checks run on threads of its own, so one server's runaway checks
never starve another server's.

One RE2 call cannot be stopped: a check given up on at its budget runs on, holding its thread,
for seconds. With one shared set of check threads, two runaway checks of one server kept both
busy and a quick check of another server waited in the queue until its own budget ran out (a
tool error for a call that did nothing wrong). Here server A makes four runaway checks at once
while server B's call, whose check is quick but off the loop (its schema has a pattern), must
pass; A's calls fail at the budget as before. The loop thread's CPU per heartbeat gap stays
under `STALL_LIMIT` beside 100 bystander passes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from loop_watch import STALL_LIMIT, beside_bystanders, quiet_transcripts
from mcp_helpers import GUARD_SECONDS, calls_then_answer, server_children, tool_results
from treadle import Session
from treadle.llm import Provider
from treadle.loop import run_session_loop
from treadle.mcp import MCPServer
from treadle.mcp.schema import MAX_PATTERN_CHARACTERS
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use the tools.")
RAW_SERVER = str(Path(__file__).with_name("mcp_raw_server.py"))
SLOW = "[ab]{1000}" * 6 + "c"  # seconds of RE2 per call at the longest string (test_mcp_budget)
LONGEST = "ab" * (MAX_PATTERN_CHARACTERS // 2 - 1) + "a"


def _server(pattern: str) -> MCPServer:
    return MCPServer.stdio(
        sys.executable, [RAW_SERVER, "--pattern", pattern], stderr=subprocess.DEVNULL
    )


def _pass(tools: list[Any], calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    with FakeOpenAIServer(script=calls_then_answer(*calls)) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=tools
        )
        out.synchronize(timeout=GUARD_SECONDS * 4)
        assert out.stop_reason == "final_answer"
        rows = [r for r in out.rows if r.kind == "tool_result"]
        return [tool_results([r])[r.payload["name"]] for r in rows]


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    warm = _server(SLOW)
    try:
        _pass(warm.tools(), [("go", {"s": "ab"})])  # the one-time imports (RE2, jsonschema)
    finally:
        warm.close()
    return quiet_transcripts()


def test_runaway_checks_of_one_server_do_not_starve_another_servers(
    quiet: list[list[dict[str, Any]]],
) -> None:
    runaway, quick = (
        _server(SLOW),
        MCPServer.stdio(
            sys.executable, [RAW_SERVER, "--pattern", "^a+$"], stderr=subprocess.DEVNULL, prefix="b"
        ),
    )
    try:
        tools = [*runaway.tools(), *quick.tools()]
        calls = [("go", {"s": LONGEST})] * 4 + [("b_go", {"s": "aaa"})]

        def both() -> list[dict[str, Any]]:
            # B's check is queued just after A's four, inside the same pass
            return _pass(tools, calls)

        bodies, stall = beside_bystanders(both, quiet)
        *slow, fine = bodies
        for body in slow:
            assert body["ok"] is False and "took over 2 s" in body["message"], body
        assert fine["ok"] is True, fine
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        runaway.close()
        quick.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}
