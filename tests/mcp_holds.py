"""Shared pieces of the MCP shape tests: the raw test server, the bystanders' quiet transcripts
after a warm-up, and how long one call held the GIL while a message was parsed (`timed`, which
the `parse_hold` fixture in conftest.py uses) with the bound the tests hold it to."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loop_watch import STALL_LIMIT, quiet_transcripts
from mcp_helpers import http_server, tool_pass


def timed(real: Callable[..., Any], held: list[float]) -> Callable[..., Any]:
    """`real`, appending the thread CPU time of each call to `held` (timed on the thread that
    runs it, which holds the GIL while a C call such as `json.loads` runs)."""

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            held.append(time.thread_time() - start)

    return timed_call


def bounded(held: list[float], stall: Any) -> None:
    """No single parse held the GIL, and the loop thread did not run, past `STALL_LIMIT`."""
    assert max(held) < STALL_LIMIT, f"a parse held the GIL {max(held) * 1000:.1f} ms of CPU"
    assert stall.cpu < STALL_LIMIT, stall


RAW_SERVER = str(Path(__file__).with_name("mcp_raw_server.py"))


def raw_server() -> Any:
    """An `MCPServer` over stdio running the raw test server (tests/mcp_raw_server.py)."""
    from treadle.mcp import MCPServer

    return MCPServer.stdio(sys.executable, [RAW_SERVER], stderr=subprocess.DEVNULL)


def warm_then_quiet(stdio_arguments: dict[str, Any], http_tool: str) -> list[list[dict[str, Any]]]:
    """The bystanders' quiet transcripts, taken after one call over stdio and one over HTTP, so
    the one-time imports of a first connection of each kind are no part of what is measured."""
    from treadle.mcp import MCPServer

    warm = raw_server()
    try:
        tool_pass(warm, "go", stdio_arguments)
    finally:
        warm.close()
    with http_server() as url:
        remote = MCPServer.http(url)
        try:
            tool_pass(remote, http_tool, {"count": 2})
        finally:
            remote.close()
    return quiet_transcripts()
