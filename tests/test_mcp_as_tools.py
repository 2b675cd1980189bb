"""`tools=[server]`: an MCP server stands for its tools; the pass lists them when it starts, on
its own loop, so the call returns at once and never connects from the caller's thread."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("mcp")

from mcp_helpers import GUARD_SECONDS, SERVER_SCRIPT, calls_then_answer, tool_results
from treadle import Session, tool
from treadle.agents import Agent
from treadle.errors import ConfigurationError, MCPServerError
from treadle.llm import Provider
from treadle.loop import arun_session_loop, run_session_loop
from treadle.mcp import MCPServer
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use the tools.")


@pytest.fixture(scope="module")
def server() -> Iterator[MCPServer]:
    srv = MCPServer.stdio(sys.executable, [SERVER_SCRIPT], stderr=subprocess.DEVNULL)
    yield srv
    srv.close()


@tool
def local_double(x: int) -> int:
    """Double x."""
    return 2 * x


def test_a_server_in_the_tool_list_is_listed_by_the_pass(server: MCPServer) -> None:
    script = calls_then_answer(("add", {"a": 2, "b": 3}), ("local_double", {"x": 4}))
    with FakeOpenAIServer(script=script) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"),
            AGENT,
            agent_provider=provider,
            tools=[local_double, server],
        )
        results = tool_results(out.synchronize(timeout=GUARD_SECONDS).rows)
        offered = {t["function"]["name"] for t in fake.requests[0].body["tools"]}
    assert results["add"] == {"ok": True, "structured": {"result": 5}}
    assert results["local_double"]["result"] == 8
    assert {"add", "echo", "local_double"} <= offered


def test_in_async_code_and_on_an_agent(server: MCPServer) -> None:
    async def main(base_url: str) -> Session:
        provider = Provider(model="fake-model", base_url=base_url, api_key="k")
        return await arun_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=[server]
        )

    with FakeOpenAIServer(script=calls_then_answer(("add", {"a": 20, "b": 22}))) as fake:
        out = asyncio.run(main(fake.base_url))
        assert tool_results(out.rows)["add"]["structured"] == {"result": 42}
        agent = Agent(
            "calc",
            instructions="Use the tools.",
            tools=[server],
            provider=Provider(model="fake-model", base_url=fake.base_url, api_key="k"),
        )
        ran = agent("go")
        assert tool_results(ran.synchronize(timeout=GUARD_SECONDS).rows)["add"]["structured"] == {
            "result": 42
        }


def test_a_server_that_cannot_start_fails_the_pass_not_the_call() -> None:
    missing = MCPServer.stdio("/nonexistent/mcp-server", stderr=subprocess.DEVNULL)
    with FakeOpenAIServer() as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=[missing]
        )  # returns at once: nothing connects here
        with pytest.raises(MCPServerError, match="could not start MCP server /nonexistent"):
            out.synchronize(timeout=GUARD_SECONDS)
        assert fake.request_count == 0  # the model was never asked


def test_a_name_clash_between_a_server_and_a_tool_is_a_clear_error(server: MCPServer) -> None:
    @tool(name="add")
    def my_add(a: int, b: int) -> int:
        """Add."""
        return a + b

    with FakeOpenAIServer() as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=[my_add, server]
        )
        with pytest.raises(ConfigurationError, match=r"named 'add'.*prefix"):
            out.synchronize(timeout=GUARD_SECONDS)
