"""MCP tools against a real MCP server (the SDK's own server API, in a subprocess), driven by
real passes against the fake model server: listing, schemas, validation, results, names, refresh,
transports, and the import hygiene of the extra."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("mcp")

from mcp_helpers import (
    GUARD_SECONDS,
    SERVER_SCRIPT,
    calls_then_answer,
    http_server,
    server_children,
    tool_results,
)
from treadle import Session
from treadle.agents import Agent
from treadle.errors import ConfigurationError, MCPServerError, RuntimeLoopError
from treadle.llm import Provider
from treadle.loop import arun_session_loop, run_session_loop
from treadle.mcp import MCPServer, MCPTool, tools_from
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use the tools.")


def _stdio(*extra: str, **options: object) -> MCPServer:
    return MCPServer.stdio(
        sys.executable, [SERVER_SCRIPT, *extra], stderr=subprocess.DEVNULL, **options
    )


@pytest.fixture(scope="module")
def server() -> Iterator[MCPServer]:
    srv = _stdio()
    yield srv
    srv.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def _run(script: object, tools: object) -> Session:
    with FakeOpenAIServer(script=script) as fake:  # type: ignore[arg-type]
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=tools
        )
        out.synchronize(timeout=GUARD_SECONDS)
        return out


def test_tools_are_listed_with_their_schemas(server: MCPServer) -> None:
    tools = server.tools()
    by_name = {t.name: t for t in tools}
    assert {"add", "echo", "hang", "die", "picture", "grow"} <= set(by_name)
    add = by_name["add"]
    assert isinstance(add, MCPTool) and add.remote_name == "add"
    assert add.description == "Add two integers."
    assert add.parameters["type"] == "object"
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    # listed once and cached: the same objects come back while the list is unchanged
    assert server.tools()[0] is tools[0]


def test_a_pass_calls_mcp_tools_and_reads_every_kind_of_result(server: MCPServer) -> None:
    script = calls_then_answer(
        ("add", {"a": 2, "b": 3}),
        ("echo", {"text": "hi"}),
        ("picture", {}),
        ("fail", {"reason": "no"}),
    )
    out = _run(script, server.tools())
    results = tool_results(out.rows)
    assert results["add"] == {"ok": True, "structured": {"result": 5}}
    assert results["echo"] == {"ok": True, "structured": {"result": "hi"}}
    assert results["picture"]["ok"] is True
    assert results["picture"]["content"].startswith("a red dot\n[image: image/png, ")
    assert "not shown" in results["picture"]["content"]
    assert results["fail"]["ok"] is False
    assert results["fail"]["error_kind"] == "tool_execution_exception"
    assert "refused: no" in results["fail"]["message"]
    assert out.stop_reason == "final_answer"


def test_arguments_are_validated_against_the_input_schema(server: MCPServer) -> None:
    out = _run(calls_then_answer(("add", {"a": "two"})), server.tools())
    result = tool_results(out.rows)["add"]
    assert result["error_kind"] == "invalid_tool_arguments"
    assert "'b' is a required property" in result["message"]
    assert "a: 'two' is not of type 'integer'" in result["message"]


def test_prefix_keeps_servers_apart_and_a_clash_is_a_clear_error(server: MCPServer) -> None:
    prefixed = _stdio(prefix="calc")
    try:
        names = [t.name for t in prefixed.tools()]
        assert "calc_add" in names and "add" not in names
        out = _run(calls_then_answer(("calc_add", {"a": 1, "b": 1})), prefixed.tools())
        assert tool_results(out.rows)["calc_add"]["structured"] == {"result": 2}
        both = tools_from(server, prefixed)
        assert len(both) == len(server.tools()) * 2
        with (
            server.connect() as other,
            pytest.raises(ConfigurationError, match=r"two tools are named 'add'.*prefix"),
        ):
            tools_from(server, other)
    finally:
        prefixed.close()


def test_tool_names_are_made_model_safe_and_a_collision_is_reported() -> None:
    colliding = _stdio("--collide")
    try:
        with pytest.raises(ConfigurationError, match=r"'read.file' and 'read_file'.*'read_file'"):
            colliding.tools()
    finally:
        colliding.close()


def test_list_changed_refreshes_the_tools(server: MCPServer) -> None:
    with server.connect() as private:
        assert "triple" not in [t.name for t in private.tools()]
        out = _run(calls_then_answer(("grow", {})), private.tools())
        assert tool_results(out.rows)["grow"]["ok"] is True
        for _ in range(int(GUARD_SECONDS / 0.05)):  # the refresh runs in the background
            if "triple" in [t.name for t in private.tools()]:
                break
            get_runtime().run(asyncio.sleep(0.05))
        out = _run(calls_then_answer(("triple", {"x": 4})), private.tools())
        assert tool_results(out.rows)["triple"]["structured"] == {"result": 12}
    # the shared connection is a different server process: its list did not change
    assert "triple" not in [t.name for t in server.tools()]


def test_tools_work_on_an_agent_and_in_an_async_pass(server: MCPServer) -> None:
    async def main(base_url: str) -> Session:
        tools = await server.list_tools()
        provider = Provider(model="fake-model", base_url=base_url, api_key="k")
        # the pass runs on this event loop; its MCP calls are handed to the runtime loop
        return await arun_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=tools
        )

    with FakeOpenAIServer(script=calls_then_answer(("add", {"a": 20, "b": 22}))) as fake:
        out = asyncio.run(main(fake.base_url))
        assert tool_results(out.rows)["add"]["structured"] == {"result": 42}
        agent = Agent(
            "calc",
            instructions="Use the tools.",
            tools=server.tools(),
            provider=Provider(model="fake-model", base_url=fake.base_url, api_key="k"),
        )
        ran = agent("go")
        ran.synchronize(timeout=GUARD_SECONDS)
        assert tool_results(ran.rows)["add"]["structured"] == {"result": 42}


def test_blocking_calls_refuse_the_runtime_loop(server: MCPServer) -> None:
    async def inside() -> None:
        with pytest.raises(RuntimeLoopError, match=r"await server\.list_tools"):
            server.tools()
        assert [t.name for t in await server.list_tools()]

    get_runtime().run(inside())


def test_streamable_http_transport() -> None:
    with http_server() as url:
        remote = MCPServer.http(url, headers={"X-Test": "1"}, prefix="web")
        try:
            out = _run(calls_then_answer(("web_add", {"a": 5, "b": 6})), remote.tools())
            assert tool_results(out.rows)["web_add"]["structured"] == {"result": 11}
            out = _run(calls_then_answer(("web_picture", {})), remote.tools())
            assert "[image: image/png" in tool_results(out.rows)["web_picture"]["content"]
        finally:
            remote.close()


def test_a_streamable_http_server_killed_mid_call() -> None:
    with http_server() as url:
        remote = MCPServer.http(url)
        try:
            pid = _structured(remote, "pid")["result"]

            async def kill_during_call() -> BaseException | None:
                call = asyncio.ensure_future(remote.call("slow", {"delay": 3600}))
                for _ in range(int(GUARD_SECONDS / 0.02)):  # until the server runs the call
                    if (await remote.call("in_flight", {})).structured_content == {"result": 1}:
                        break
                    await asyncio.sleep(0.02)
                os.kill(pid, signal.SIGKILL)
                try:
                    await call
                except MCPServerError as error:
                    return error
                return None

            error = get_runtime().run(kill_during_call(), timeout=GUARD_SECONDS)
            assert error is not None and "closed the connection during the call" in str(error)
            # gone for good: the next call says so at once instead of hanging
            with pytest.raises(MCPServerError, match="could not start MCP server http"):
                _structured(remote, "pid")
        finally:
            remote.close()


def _structured(server: MCPServer, name: str) -> dict[str, object]:
    result = get_runtime().run(server.call(name, {}), timeout=GUARD_SECONDS)
    assert result.structured_content is not None
    return result.structured_content


def test_a_server_that_cannot_start_is_a_tool_error_and_a_clear_error() -> None:
    missing = MCPServer.stdio("/nonexistent/mcp-server", stderr=subprocess.DEVNULL)
    with pytest.raises(MCPServerError, match=r"could not start MCP server /nonexistent"):
        missing.tools()
    unreachable = MCPServer.http("http://127.0.0.1:9/mcp", connect_timeout=5)
    with pytest.raises(MCPServerError, match=r"could not start MCP server http://127\.0\.0\.1:9"):
        unreachable.tools()


@pytest.mark.parametrize(
    "make",
    [
        lambda: MCPServer.stdio(""),
        lambda: MCPServer.stdio("python", "-m server"),  # type: ignore[arg-type]
        lambda: MCPServer.http("127.0.0.1:8000/mcp"),
        lambda: _stdio(timeout=0),
        lambda: _stdio(max_concurrency=0),
        lambda: _stdio(prefix=""),
    ],
)
def test_bad_configuration_raises_at_construction(make: object) -> None:
    with pytest.raises(ConfigurationError):
        make()  # type: ignore[operator]


def test_importing_treadle_never_imports_the_sdk() -> None:
    code = (
        "import sys, treadle, treadle.tools, treadle.loop, treadle.agents, treadle.testing\n"
        "import treadle.cli.app, treadle.cli.run\n"
        "from treadle import *\n"
        "bad = sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'mcp_')))\n"
        "assert not bad, bad\n"
        "assert 'treadle.mcp' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=GUARD_SECONDS)
