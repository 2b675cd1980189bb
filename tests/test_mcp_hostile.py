"""MCP servers that attack the shared runtime loop, each beside 100 bystander passes.

A schema regex that backtracks for minutes in Python's `re`, a `$ref` loop, 20,000 tool-list
announcements, a 64 MiB reply, a server that writes its stderr without end: each must end as a
tool error (or a clear refusal) for its own pass only, while the bystanders' transcripts come out
as in a quiet run and the runtime loop thread never spends more than `STALL_LIMIT` of CPU time
between two heartbeats (tests/loop_watch.py measures it; CPU time, unlike the wall-clock gap it
also prints, does not stretch when the shared machine is loaded). Every test ends with no server
process left.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("mcp")

from loop_watch import STALL_LIMIT, beside_bystanders, quiet_transcripts
from mcp_helpers import (
    GUARD_SECONDS,
    SERVER_SCRIPT,
    calls_then_answer,
    http_server,
    server_children,
    tool_results,
)
from treadle import Session
from treadle.errors import ConfigurationError, MCPSchemaError, MCPServerError, ToolError
from treadle.llm import Provider
from treadle.loop import run_session_loop
from treadle.mcp import MCPServer
from treadle.mcp.listing import REFRESH_MAX_WAIT
from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Use the tools.")
MIB = 1024 * 1024


def _stdio(*extra: str, **options: Any) -> MCPServer:
    options.setdefault("stderr", subprocess.DEVNULL)
    return MCPServer.stdio(sys.executable, [SERVER_SCRIPT, *extra], **options)


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    # One connection first, so the stalls measured are the hostile cases' and not the one-time
    # imports of a first connection (the SDK's client, jsonschema, RE2).
    warm = _stdio()
    try:
        _pass(warm, ("add", {"a": 1, "b": 1}))
    finally:
        warm.close()
    return quiet_transcripts()


@pytest.fixture
def server() -> Iterator[MCPServer]:
    server = _stdio()
    server.tools()
    yield server
    server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def _pass(server: MCPServer, *calls: tuple[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    with FakeOpenAIServer(script=calls_then_answer(*calls)) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"), AGENT, agent_provider=provider, tools=server.tools()
        )
        out.synchronize(timeout=GUARD_SECONDS * 4)
        assert out.stop_reason == "final_answer"
        return tool_results(out.rows)


def _call(server: MCPServer, name: str, **arguments: Any) -> Any:
    return get_runtime().run(server.call(name, arguments), timeout=GUARD_SECONDS * 4)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_backtracking_pattern_costs_the_loop_nothing(
    server: MCPServer, quiet: list[list[dict[str, Any]]]
) -> None:
    # `^(a+)+$` against 28 `a`s and a `b`: 2^28 steps in Python's `re`, linear in RE2.
    calls = (("match", {"text": "a" * 28 + "b"}),)
    results, stall = beside_bystanders(lambda: _pass(server, *calls), quiet)
    bad = results["match"]
    assert bad["ok"] is False and bad["error_kind"] == "invalid_tool_arguments"
    assert "does not match '^(a+)+$'" in bad["message"]
    assert stall.cpu < STALL_LIMIT, stall
    assert _pass(server, ("match", {"text": "a" * 28}))["match"]["structured"] == {
        "result": "matched 28"
    }


def test_a_backtracking_output_pattern_costs_the_loop_nothing(
    server: MCPServer, quiet: list[list[dict[str, Any]]]
) -> None:
    # The SDK checks a structured result with Python's `re`; Treadle's session checks it on RE2.
    listed = {t.remote_name: t for t in server.tools()}
    assert listed["spell"].output_schema is not None
    text = "a" * 28 + "b"
    error, stall = beside_bystanders(lambda: _refused_call(server, "spell", text=text), quiet)
    assert isinstance(error, ToolError) and "does not match '^(a+)+$'" in str(error)
    assert stall.cpu < STALL_LIMIT, stall
    assert _call(server, "spell", text="aaaa").structured_content == {"result": "aaaa"}


def test_a_cyclic_schema_is_refused_when_listed(quiet: list[list[dict[str, Any]]]) -> None:
    cyclic = _stdio("--cyclic")
    try:

        def listing() -> BaseException | None:
            try:
                cyclic.tools()
            except MCPSchemaError as error:
                return error
            return None

        error, stall = beside_bystanders(listing, quiet)
        assert error is not None
        message = str(error)
        assert "tool 'loop'" in message and cyclic.label in message  # the label is cut at 80
        assert "$ref chain loops without descending" in message
        assert stall.cpu < STALL_LIMIT, stall
        # a pass given the server fails with the same error, not with RecursionError
        with FakeOpenAIServer(script=calls_then_answer(("loop", {"x": 1}))) as fake:
            provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
            out = run_session_loop(
                Session.from_user_message("go"), AGENT, agent_provider=provider, tools=[cyclic]
            )
            with pytest.raises(MCPSchemaError, match="tool 'loop'"):
                out.synchronize(timeout=GUARD_SECONDS)
    finally:
        cyclic.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_twenty_thousand_list_changed_cause_a_handful_of_listings(
    server: MCPServer, quiet: list[list[dict[str, Any]]]
) -> None:
    assert _call(server, "add", a=1, b=2).structured_content == {"result": 3}
    before = _rss_mib()
    started = time.perf_counter()
    result, stall = beside_bystanders(lambda: _call(server, "storm", count=20_000), quiet)
    storm = time.perf_counter() - started
    assert result.structured_content == {"result": "announced 20000"}
    assert _call(server, "add", a=2, b=2).structured_content == {"result": 4}
    grown = _rss_mib() - before
    print(f"listings {server.listings} over a {storm:.1f} s storm, peak RSS grew {grown:.1f} MiB")
    # the first listing, one at the start of the storm, then one per REFRESH_MAX_WAIT at most
    # while it lasts (2 to 5 in all on this machine), and one after it
    assert server.listings <= 3 + storm / REFRESH_MAX_WAIT
    assert server.restarts == 0
    assert grown < 64
    assert stall.cpu < STALL_LIMIT, stall


def test_closing_during_a_notification_storm_stops_the_server() -> None:
    storming = _stdio()
    pid = _call(storming, "pid").structured_content["result"]

    async def storm_then_close() -> float:
        call = asyncio.ensure_future(storming.call("storm", {"count": 20_000}))
        await asyncio.sleep(0.2)  # the storm is under way (or over: either must close cleanly)
        started = time.perf_counter()
        await storming.aclose()
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        return time.perf_counter() - started

    took = get_runtime().run(storm_then_close(), timeout=GUARD_SECONDS * 2)
    print(f"aclose during a storm took {took * 1000:.0f} ms")
    assert server_children(settle_seconds=GUARD_SECONDS) == {}
    assert pid not in server_children()


def test_a_reply_over_the_cap_is_a_tool_error_and_restarts(
    server: MCPServer, quiet: list[list[dict[str, Any]]]
) -> None:
    first = _call(server, "pid").structured_content["result"]
    results, stall = beside_bystanders(lambda: _pass(server, ("big", {"mib": 64})), quiet)
    refused = results["big"]
    assert refused["ok"] is False and refused["error_kind"] == "tool_execution_exception"
    assert f"max_message_bytes cap of {DEFAULT_MAX_MESSAGE_BYTES:,} bytes" in refused["message"]
    assert stall.cpu < STALL_LIMIT, stall
    # the connection was closed with its process; the next call starts a new one
    assert _call(server, "pid").structured_content["result"] != first
    assert server.restarts == 1


@pytest.mark.parametrize("shape", ["sse", "json"])
def test_an_http_reply_over_the_cap_is_a_tool_error(
    shape: str, quiet: list[list[dict[str, Any]]]
) -> None:
    extra = ("--json",) if shape == "json" else ()
    with http_server(*extra) as url:
        remote = MCPServer.http(url)
        try:
            error, stall = beside_bystanders(lambda: _refused_call(remote, "big", mib=64), quiet)
            assert isinstance(error, MCPServerError), error
            wanted = (
                "byte limit"
                if shape == "sse"
                else f"max_message_bytes cap of {DEFAULT_MAX_MESSAGE_BYTES:,}"
            )
            assert wanted in str(error)
            assert "closed" in str(error)
            assert stall.cpu < STALL_LIMIT, stall
            # the server still serves, on a fresh connection (the capped one was closed)
            assert _call(remote, "add", a=1, b=2).structured_content == {"result": 3}
            assert remote.restarts == 1
        finally:
            remote.close()


def _refused_call(server: MCPServer, name: str, **arguments: Any) -> BaseException | None:
    try:
        _call(server, name, **arguments)
    except ToolError as error:
        return error
    return None


def test_a_64_mib_reply_under_a_raised_cap_is_read_whole() -> None:
    roomy = _stdio(max_message_bytes=128 * MIB)
    try:
        started = time.perf_counter()
        result = _call(roomy, "big", mib=64)
        took = time.perf_counter() - started
        text = result.content[0].text
        assert len(text) == 64 * MIB and text == "x" * len(text)
        print(f"a 64 MiB reply (server serialising included) took {took:.2f} s")
    finally:
        roomy.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


class _Counting(logging.Handler):
    """Counts the stderr lines logged and keeps the last (holding 200,000 records, as pytest's
    log capture does, would make the garbage collector's pauses part of the stall measured)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if " stderr: " in message:
            self.lines += 1
            self.last = message


_RAW_WRITER = """
import sys
sys.stdin.readline()
size = int(sys.argv[1])
head = b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"'
sys.stdout.buffer.write(head + b"x" * size + b'"}],"isError":false}}\\n')
sys.stdout.flush()
"""


def test_the_reader_alone_is_linear_in_the_message_size() -> None:
    """Our reader without the SDK server's own serialising: a process that writes one ready
    reply; prints the times (16 and 64 MiB: linear means about 4x, quadratic 16x)."""
    import mcp_types as types
    from mcp.shared.message import SessionMessage

    from treadle.mcp.stdio import StdioTransport

    async def read(mib: int) -> float:
        transport = StdioTransport(
            sys.executable,
            ["-c", _RAW_WRITER, str(mib * MIB)],
            env=None,
            cwd=None,
            stderr=subprocess.DEVNULL,
            max_message_bytes=128 * MIB,
            label=f"writer of {mib} MiB",
        )
        async with transport as (incoming, outgoing):
            ping = types.jsonrpc_message_adapter.validate_python(
                {"jsonrpc": "2.0", "id": 1, "method": "ping"}
            )
            started = time.perf_counter()
            await outgoing.send(SessionMessage(ping))
            reply = await incoming.receive()
            took = time.perf_counter() - started
        text = reply.message.result["content"][0]["text"]
        assert len(text) == mib * MIB
        return took

    times = {mib: get_runtime().run(read(mib), timeout=GUARD_SECONDS * 2) for mib in (16, 64)}
    print(
        f"reader alone: 16 MiB {times[16]:.2f} s, 64 MiB {times[64]:.2f} s "
        f"(ratio {times[64] / times[16]:.1f})"
    )
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_a_chatty_stderr_pipe_is_read_and_logged(quiet: list[list[dict[str, Any]]]) -> None:
    chatty = _stdio(stderr=subprocess.PIPE)
    logger = logging.getLogger("treadle.mcp")
    handler, level = _Counting(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # past pytest's capture, which keeps every record
    try:
        # ~20 MB of stderr: a pipe nobody reads blocks the server after 64 KiB.
        result, stall = beside_bystanders(lambda: _call(chatty, "chatty", lines=200_000), quiet)
        assert result.structured_content == {"result": "said 200000"}
        deadline = time.monotonic() + GUARD_SECONDS
        while handler.lines < 200_000 and time.monotonic() < deadline:
            time.sleep(0.05)  # the last lines may still be in the pipe when the reply is read
        assert handler.lines == 200_000 and "stderr: 199999 chatter" in handler.last
        assert stall.cpu < STALL_LIMIT, stall
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = True
        chatty.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_stderr_into_stdout_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="stdout carries the protocol"):
        MCPServer.stdio(sys.executable, [SERVER_SCRIPT], stderr=subprocess.STDOUT)
    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        MCPServer.stdio(sys.executable, [SERVER_SCRIPT], max_message_bytes=10)


def test_a_server_that_dies_at_start_is_quoted_from_its_stderr() -> None:
    crashing = MCPServer.stdio(
        sys.executable,
        [
            "-c",
            "import sys; sys.stderr.write('config file missing: /etc/demo.toml\\n'); sys.exit(1)",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        with pytest.raises(MCPServerError, match=r"stderr ended with: config file missing"):
            crashing.tools()
    finally:
        crashing.close()


def test_a_missing_server_is_still_a_clear_start_error() -> None:
    missing = MCPServer.stdio("/nonexistent/mcp-server")
    with pytest.raises(MCPServerError, match="could not start MCP server /nonexistent/mcp-server"):
        missing.tools()
    missing.close()


def _gzip_bomb_server(mib: int) -> tuple[Any, str]:
    """A JSON-reply MCP server on 127.0.0.1 whose `boom` reply is gzip: small on the wire,
    `mib` MiB once inflated; returns the server (to shut down) and its MCP URL."""
    import json
    import threading
    import zlib
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def bomb(mid: int) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        head = b'{"jsonrpc":"2.0","id":%d,"result":{"content":[{"type":"text","text":"' % mid
        parts = [packer.compress(head)]
        parts += [packer.compress(b"a" * MIB) for _ in range(mib)]
        parts += [packer.compress(b'"}],"isError":false}}'), packer.flush()]
        return b"".join(parts)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            return

        def _send(self, code: int, body: bytes = b"", headers: tuple[Any, ...] = ()) -> None:
            self.send_response(code)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(405)

        def do_DELETE(self) -> None:
            self._send(200)

        def do_POST(self) -> None:
            message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            mid, method = message.get("id"), message.get("method")
            sid = (("mcp-session-id", "s1"),)
            if mid is None:
                return self._send(202, b"", sid)
            result: dict[str, Any] = {}
            if method == "initialize":
                result = {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "bomb", "version": "0"},
                }
            elif method == "tools/list":
                result = {"tools": [{"name": "boom", "inputSchema": {"type": "object"}}]}
            elif method == "tools/call":
                kind = ("Content-Type", "application/json")
                return self._send(200, bomb(mid), (*sid, kind, ("Content-Encoding", "gzip")))
            body = json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}).encode()
            return self._send(200, body, (*sid, ("Content-Type", "application/json")))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/mcp"


def test_a_gzip_reply_is_capped_by_its_inflated_size() -> None:
    # 32 MiB inflated, a few dozen KiB on the wire: the cap (1 MiB) counts what it inflates to
    httpd, url = _gzip_bomb_server(32)
    remote = MCPServer.http(url)
    try:
        error = _refused_call(remote, "boom")
        assert isinstance(error, ToolError), error
        assert f"max_message_bytes cap of {DEFAULT_MAX_MESSAGE_BYTES:,}" in str(error)
        # the next call works, on a new connection
        assert _refused_call(remote, "boom") is not None
        assert remote.restarts == 1
    finally:
        remote.close()
        httpd.shutdown()
        httpd.server_close()


def test_a_small_gzip_reply_is_inflated_and_read() -> None:
    httpd, url = _gzip_bomb_server(1)
    remote = MCPServer.http(url, max_message_bytes=2 * MIB)
    try:
        text = _call(remote, "boom").content[0].text
        assert text == "a" * MIB
    finally:
        remote.close()
        httpd.shutdown()
        httpd.server_close()
