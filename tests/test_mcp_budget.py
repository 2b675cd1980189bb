"""Schema checks that run past their time budget: beside 100 bystander passes, and at exit.

One RE2 call cannot be interrupted and costs up to the pattern's size per character, so a
string of 99,999 characters against `[ab]{1000}` repeated is seconds of work in one call. The
check runs on a check thread of its own; past `CHECK_BUDGET_SECONDS` the call fails as a tool
error naming tool and server, the bystanders' transcripts come out as in a quiet run, and the
runtime loop thread never spends more than `STALL_LIMIT` of CPU time between two heartbeats
(RE2 lets go of the GIL while it matches, so the loop's wall-clock gap is printed beside it).
The check thread runs on, unheard, and must not keep the process from exiting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
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
HERE = Path(__file__).parent
RAW_SERVER = str(HERE / "mcp_raw_server.py")
# Seconds of RE2 per call at the longest string matched, a few times the 2 s budget (more repeats,
# more seconds: 16 ran 12 s of CPU on this machine).
SLOW = "[ab]{1000}" * 6 + "c"
LONGEST = "ab" * (MAX_PATTERN_CHARACTERS // 2 - 1) + "a"


def _server(*extra: str, pattern: str = SLOW) -> MCPServer:
    return MCPServer.stdio(
        sys.executable, [RAW_SERVER, "--pattern", pattern, *extra], stderr=subprocess.DEVNULL
    )


def _pass(server: MCPServer, arguments: dict[str, Any]) -> dict[str, Any]:
    with FakeOpenAIServer(script=calls_then_answer(("go", arguments))) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=server.tools()
        )
        out.synchronize(timeout=GUARD_SECONDS * 4)
        assert out.stop_reason == "final_answer"
        return tool_results(out.rows)["go"]


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    warm = _server()
    try:
        _pass(warm, {"s": "ab" * 10 + "a"})  # the one-time imports (RE2, jsonschema)
    finally:
        warm.close()
    return quiet_transcripts()


@pytest.mark.parametrize("which", ["arguments", "structured result"])
def test_a_check_past_its_budget_fails_its_call_only(
    which: str, quiet: list[list[dict[str, Any]]]
) -> None:
    server = _server("--output-pattern") if which != "arguments" else _server()
    arguments = (
        {"s": LONGEST}
        if which == "arguments"
        else {"kind": "long", "n": MAX_PATTERN_CHARACTERS // 2 - 1}
    )
    try:
        server.tools()
        body, stall = beside_bystanders(lambda: _pass(server, arguments), quiet)
        assert body["ok"] is False and body["error_kind"] == "tool_execution_exception", body
        assert "took over 2 s and was stopped" in body["message"], body
        if which == "arguments":
            assert "'go'" in body["message"] and server.label in body["message"], body
            assert "the tool was not called" in body["message"], body
        assert stall.cpu < STALL_LIMIT, stall
        assert server.restarts == 0  # the call failed, not the connection
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


_CHILD = textwrap.dedent(
    """
    import atexit, json, subprocess, sys, threading
    sys.path.insert(0, {here!r})
    from test_mcp_budget import LONGEST, _pass, _server

    def still_checking():
        # atexit handlers run after interpreter exit joined the threads it waits for
        alive = [t.name for t in threading.enumerate() if t.name.startswith("treadle-mcp-check")]
        print("CHECKING AT EXIT", len(alive), flush=True)

    atexit.register(still_checking)
    server = _server(pattern={pattern!r})
    print(json.dumps(_pass(server, {{"s": LONGEST}})), flush=True)
    """
)


def test_a_runaway_check_does_not_hold_up_interpreter_exit() -> None:
    # tens of seconds in one RE2 call, past the end of the child's pass
    script = _CHILD.format(here=str(HERE), pattern="[ab]{1000}" * 16 + "c")
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS * 2,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    body = json.loads(lines[0])
    assert body["ok"] is False and "took over 2 s and was stopped" in body["message"], body
    # the check was still running when the interpreter exited: nothing waited for it
    assert lines[-1].startswith("CHECKING AT EXIT") and int(lines[-1].split()[-1]) >= 1, lines
