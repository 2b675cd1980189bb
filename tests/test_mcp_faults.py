"""MCP servers that fail: killed mid-call, exiting mid-call, a tool that hangs, a server that
freezes, a pass cancelled during a call; connections closed at shutdown and at exit with no
server process left behind; 500 concurrent passes sharing one stdio server; and a third-party
server from PyPI (`mcp-server-time`) driven by a real pass."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

pytest.importorskip("mcp")

from mcp_helpers import (
    GUARD_SECONDS,
    SERVER_SCRIPT,
    alive,
    calls_then_answer,
    gone,
    server_children,
    tool_results,
)
from treadle import Session
from treadle.errors import MCPServerError, ToolTimeoutError
from treadle.llm import Provider
from treadle.loop import run_session_loop
from treadle.mcp import MCPServer
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use the tools.")


def _stdio(**options: object) -> MCPServer:
    return MCPServer.stdio(sys.executable, [SERVER_SCRIPT], stderr=subprocess.DEVNULL, **options)


def _call(server: MCPServer, name: str, **arguments: object) -> object:
    """One call on the runtime, as a pass makes it; returns the structured result."""
    result = get_runtime().run(server.call(name, dict(arguments)), timeout=GUARD_SECONDS)
    return result.structured_content["result"] if result.structured_content else None


def _pid(server: MCPServer) -> int:
    pid = _call(server, "pid")
    assert isinstance(pid, int)
    return pid


@pytest.fixture
def fresh() -> Iterator[MCPServer]:
    # A short call timeout; a generous ping timeout, so a loaded machine is not taken for a hang.
    server = _stdio(timeout=2, ping_timeout=GUARD_SECONDS)
    yield server
    server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_server_killed_mid_call_is_a_tool_error_and_restarts(fresh: MCPServer) -> None:
    first = _pid(fresh)

    async def kill_during_call() -> BaseException | None:
        call = asyncio.ensure_future(fresh.call("slow", {"delay": 3600}))
        for _ in range(int(GUARD_SECONDS / 0.02)):  # wait until the server runs the call
            if (await fresh.call("peak", {})).structured_content == {"result": 1}:
                break
            await asyncio.sleep(0.02)
        os.kill(first, signal.SIGKILL)
        try:
            await call
        except MCPServerError as error:
            return error
        return None

    error = get_runtime().run(kill_during_call(), timeout=GUARD_SECONDS)
    assert error is not None and "closed the connection during the call to 'slow'" in str(error)
    second = _pid(fresh)  # the next call starts the server again
    assert second != first and fresh.restarts == 1
    assert not alive(first)


def test_a_server_exiting_mid_call_gives_the_model_a_tool_error(fresh: MCPServer) -> None:
    first = _pid(fresh)
    with FakeOpenAIServer(script=calls_then_answer(("die", {}))) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=fresh.tools()
        )
        result = tool_results(out.rows)["die"]
    assert result["ok"] is False and result["error_kind"] == "tool_execution_exception"
    assert "will be started again on the next call" in result["message"]
    assert out.stop_reason == "final_answer"
    assert _pid(fresh) != first and not alive(first)


def test_a_hanging_tool_times_out_and_the_server_keeps_serving(fresh: MCPServer) -> None:
    first = _pid(fresh)
    with pytest.raises(ToolTimeoutError, match=r"'hang' .* did not answer within 2 s"):
        _call(fresh, "hang")
    # the server answered the health ping, so it was not restarted; the hung call was cancelled
    assert _call(fresh, "add", a=1, b=2) == 3
    assert _pid(fresh) == first and fresh.restarts == 0


def test_a_frozen_server_is_restarted_on_a_later_call() -> None:
    server = _stdio(timeout=2, ping_timeout=1)
    try:
        _restarted_after_freezing(server)
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def _restarted_after_freezing(fresh: MCPServer) -> None:
    first = _pid(fresh)
    with pytest.raises(ToolTimeoutError):
        _call(fresh, "freeze")
    pid = first
    for _ in range(5):  # calls made before the ping gives up time out or see the hang-up
        try:
            pid = _pid(fresh)
        except (ToolTimeoutError, MCPServerError):
            continue
        if pid != first:
            break
    assert pid != first and fresh.restarts >= 1
    assert server_children(settle_seconds=GUARD_SECONDS, expect={pid}).keys() == {pid}


def test_cancelling_a_pass_cancels_its_mcp_call() -> None:
    server = _stdio(timeout=600)
    try:
        with FakeOpenAIServer(script=calls_then_answer(("slow", {"delay": 3600}))) as fake:
            provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
            out = run_session_loop(
                Session.from_user_message("go"),
                AGENT,
                agent_provider=provider,
                tools=server.tools(),
            )
            for _ in range(int(GUARD_SECONDS / 0.02)):  # until the server runs the call
                if _call(server, "in_flight") == 1:
                    break
                get_runtime().run(asyncio.sleep(0.02))
            assert _call(server, "in_flight") == 1
            out.cancel()
            out.synchronize(timeout=GUARD_SECONDS)
            assert out.stop_reason == "cancelled"
        # the server was told to cancel: its handler stopped, not only our wait for it
        for _ in range(int(GUARD_SECONDS / 0.02)):
            if _call(server, "in_flight") == 0:
                break
            get_runtime().run(asyncio.sleep(0.02))
        assert _call(server, "in_flight") == 0
        assert server.restarts == 0
    finally:
        server.close()


def test_500_concurrent_passes_share_one_stdio_server() -> None:
    server = _stdio(max_concurrency=8)
    try:
        script = calls_then_answer(
            ("slow", {"delay": 0.005, "tag": "x"}), ("add", {"a": 1, "b": 2})
        )
        with FakeOpenAIServer(script=script) as fake:
            provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
            tools = server.tools()
            outs = [
                run_session_loop(
                    Session.from_user_message(f"go {i}"),
                    AGENT,
                    agent_provider=provider,
                    tools=tools,
                )
                for i in range(500)
            ]
            for out in outs:
                out.synchronize(timeout=GUARD_SECONDS * 4)
        for out in outs:
            results = tool_results(out.rows)
            assert results["slow"] == {"ok": True, "structured": {"result": "slept x"}}
            assert results["add"] == {"ok": True, "structured": {"result": 3}}
        peak = _call(server, "peak")
        assert isinstance(peak, int) and 1 <= peak <= 8  # the per-server concurrency limit held
        assert server.restarts == 0 and len(server_children()) == 1
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_third_party_time_server_from_pypi() -> None:
    pytest.importorskip("mcp_server_time")
    time_server = MCPServer.stdio(
        sys.executable,
        ["-m", "mcp_server_time", "--local-timezone", "UTC"],
        stderr=subprocess.DEVNULL,
        prefix="time",
    )
    try:
        names = {t.name for t in time_server.tools()}
        assert {"time_get_current_time", "time_convert_time"} <= names
        script = calls_then_answer(
            ("time_get_current_time", {"timezone": "Europe/Paris"}),
            ("time_convert_time", {"source_timezone": "UTC", "time": "12:00"}),
        )
        with FakeOpenAIServer(script=script) as fake:
            provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
            out = run_session_loop(
                Session.from_user_message("What time is it in Paris?"),
                AGENT,
                agent_provider=provider,
                tools=time_server.tools(),
            )
            results = tool_results(out.rows)
        now = results["time_get_current_time"]
        assert now["ok"] is True
        assert "Europe/Paris" in json.dumps(now)
        bad = results["time_convert_time"]  # target_timezone is required by its schema
        assert bad["error_kind"] == "invalid_tool_arguments"
        assert "'target_timezone' is a required property" in bad["message"]
        assert out.stop_reason == "final_answer"
    finally:
        time_server.close()


_EXIT_SCRIPT = """
import subprocess, sys
from treadle.mcp import MCPServer
from treadle.runtime import get_runtime
servers = [
    MCPServer.stdio(sys.executable, [{script!r}], stderr=subprocess.DEVNULL) for _ in range(3)
]
for server in servers:
    result = get_runtime().run(server.call("pid", {{}}))
    print(result.structured_content["result"], flush=True)
{ending}
"""


@pytest.mark.parametrize("ending", ["", "import treadle.runtime; treadle.runtime.shutdown()"])
def test_no_server_process_outlives_the_program(ending: str) -> None:
    code = textwrap.dedent(_EXIT_SCRIPT).format(script=SERVER_SCRIPT, ending=ending)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_SECONDS * 2
    )
    assert done.returncode == 0, done.stderr
    pids = [int(line) for line in done.stdout.split()]
    assert len(pids) == 3
    # the program closed its servers before exiting (atexit runs the runtime's shutdown)
    assert [pid for pid in pids if not gone(pid, settle_seconds=0)] == []


def test_a_server_object_nobody_holds_closes_its_connection() -> None:
    server = _stdio()
    pid = _pid(server)
    assert alive(pid)
    del server
    gc.collect()
    assert gone(pid)
    assert server_children() == {}
