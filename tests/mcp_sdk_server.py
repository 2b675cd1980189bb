"""An MCP server written with the SDK's own server API, for tests/test_mcp*.py.

Run it as `python mcp_sdk_server.py` (stdio) or `python mcp_sdk_server.py --http` (streamable HTTP
on 127.0.0.1, an ephemeral port, printed as `PORT <n>` on stdout once listening). `--collide`
adds two tools whose names clash once made model-safe; `--cyclic` lists a tool whose input schema
is a `$ref` loop; `--escape FILE` leaves a grandchild that double-forks, calls `setsid()`,
ignores SIGTERM and writes its pid to FILE; `--ignore-term` makes the server ignore SIGTERM;
`--json` makes the HTTP server answer with JSON bodies instead of SSE. The hostile tools
(`match`, `spell`, `storm`, `big`, `blocks`, `chatty`) serve tests/test_mcp_hostile.py, `lists`
tests/test_mcp_shapes.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from typing import Annotated

from mcp.server import MCPServer
from mcp.server.mcpserver import Context, Image
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import (
    CallToolResult,
    NotificationParams,
    TextContent,
    ToolListChangedNotification,
)
from pydantic import Field

app = MCPServer("treadle-test", log_level="WARNING")
_in_flight = 0
_peak = 0

# A 1x1 PNG: the bytes of an image result.
_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63000100000500010d0a2db40000000049454e44ae426082"
)


def host_pid() -> int:
    """This process's pid outside the supervisor's PID namespace (`os.getpid()` gives the one
    inside it): /proc is the host's mount, so /proc/self names the host pid."""
    return int(os.readlink("/proc/self"))


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@app.tool()
def pid() -> int:
    """The server's process id, as the test process sees it."""
    return host_pid()


@app.tool()
async def slow(delay: float, tag: str = "") -> str:
    """Sleep `delay` seconds, counting calls in flight."""
    global _in_flight, _peak
    _in_flight += 1
    _peak = max(_peak, _in_flight)
    try:
        await asyncio.sleep(delay)
    finally:
        _in_flight -= 1
    return f"slept {tag}"


@app.tool()
def peak() -> int:
    """The most `slow` calls that were in flight at once."""
    return _peak


@app.tool()
def in_flight() -> int:
    """How many `slow` calls are running now."""
    return _in_flight


@app.tool()
async def hang() -> str:
    """Never returns (until cancelled)."""
    await asyncio.sleep(3600)
    return "woke"


@app.tool()
async def freeze() -> str:
    """Blocks the whole server, its event loop included, for an hour."""
    time.sleep(3600)  # noqa: ASYNC251 - freezing the server's loop is the point
    return "thawed"


@app.tool()
def die() -> str:
    """Exits the server process at once, mid-call."""
    os._exit(3)


@app.tool()
def fail(reason: str) -> str:
    """Fails on purpose."""
    raise ToolError(f"refused: {reason}")


@app.tool(structured_output=False)
def picture() -> list[object]:
    """Some text and a small image."""
    return ["a red dot", Image(data=_PNG, format="png")]


@app.tool()
async def grow(ctx: Context) -> str:
    """Adds a tool named `triple` and announces the changed list."""

    def triple(x: int) -> int:
        """Multiply by three."""
        return 3 * x

    app.add_tool(triple, name="triple")
    await ctx.session.send_tool_list_changed()
    return "grown"


@app.tool()
def match(text: Annotated[str, Field(pattern="^(a+)+$")]) -> str:
    """Accepts runs of `a` (its schema's pattern backtracks catastrophically in Python's `re`)."""
    return f"matched {len(text)}"


@app.tool()
def spell(text: str) -> str:
    """Returns the text; its output schema's pattern backtracks catastrophically in `re`."""
    return text


# The output schema the server lists for `spell` (its own result is never checked against it).
app._tool_manager._tools["spell"].fn_metadata.output_schema["properties"]["result"]["pattern"] = (
    "^(a+)+$"
)


@app.tool()
async def storm(ctx: Context, count: int) -> str:
    """Announces a changed tool list `count` times in a row."""
    for _ in range(count):
        await ctx.session.send_tool_list_changed()
    return f"announced {count}"


@app.tool()
async def announce(ctx: Context, count: int) -> str:
    """Announces a changed tool list whose `_meta` holds `count` entries `[[[]]]`, on the call's
    own stream, then answers."""
    params = NotificationParams.model_validate({"_meta": {"x": [[[]]] * count}})
    note = ToolListChangedNotification(params=params)
    await ctx.session.send_notification(note, related_request_id=ctx.request_id)
    return f"announced {count}"


@app.tool(structured_output=False)
def big(mib: int) -> str:
    """A text result of `mib` MiB."""
    return "x" * (mib * 1024 * 1024)


@app.tool(structured_output=False)
def blocks(count: int) -> list[str]:
    """A result of `count` small text blocks (a message that is costly to parse, not to read)."""
    return ["b"] * count


@app.tool(structured_output=False)
def lists(count: int) -> CallToolResult:
    """A structured result of `count` entries `[[[]]]` (the most lists per byte of JSON)."""
    content = [TextContent(type="text", text="lists")]
    return CallToolResult(content=content, structuredContent={"x": [[[]]] * count})


@app.tool()
def chatty(lines: int) -> str:
    """Writes `lines` lines to stderr before answering."""
    text = "chatter " * 12
    for i in range(lines):
        sys.stderr.write(f"{i} {text}\n")
    sys.stderr.flush()
    return f"said {lines}"


def _cyclic() -> None:
    app.add_tool(lambda x: x, name="loop", description="its schema's $ref loops forever")
    app._tool_manager._tools["loop"].parameters = {
        "type": "object",
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        "properties": {"x": {"$ref": "#/$defs/a"}},
    }


def _escape(pid_file: str) -> None:
    """Leave a grandchild outside our process group that ignores SIGTERM (the hardest orphan)."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(pid_file + ".tmp", "w") as f:
                f.write(str(host_pid()))
            os.replace(pid_file + ".tmp", pid_file)
            while True:
                time.sleep(3600)
        os._exit(0)
    os.wait()


def _collide() -> None:
    app.add_tool(lambda: "dot", name="read.file", description="clashes with read_file")
    app.add_tool(lambda: "underscore", name="read_file", description="clashes with read.file")


async def _serve_http(json_response: bool) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue from now on, before uvicorn takes the socket
    starlette_app = app.streamable_http_app(host="127.0.0.1", json_response=json_response)
    config = uvicorn.Config(starlette_app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    await server.serve(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--collide", action="store_true")
    parser.add_argument("--cyclic", action="store_true")
    parser.add_argument("--escape", metavar="PID_FILE")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--json", action="store_true", help="HTTP replies as JSON, not SSE")
    args = parser.parse_args()
    if args.collide:
        _collide()
    if args.escape:
        _escape(args.escape)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.cyclic:
        _cyclic()
    if args.http:
        asyncio.run(_serve_http(args.json))
    else:
        app.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
