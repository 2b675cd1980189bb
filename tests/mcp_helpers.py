"""Shared pieces of the MCP tests: the SDK test server's command, a fake model script that calls
named tools, and a scan for this test process's own MCP server children (for orphan checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from treadle import Provider, Session, run_session_loop
from treadle.testing import FakeOpenAIServer
from treadle.testing.fake_replies import Reply

SERVER_SCRIPT = str(Path(__file__).with_name("mcp_sdk_server.py"))
# Generous hang guards, not timing assertions.
GUARD_SECONDS = 30.0


def calls_then_answer(*calls: tuple[str, dict[str, Any]]) -> Callable[[dict[str, Any]], Reply]:
    """A stateless fake-model script: call `calls` in parallel, then answer with the results."""

    def script(request: dict[str, Any]) -> Reply:
        messages = request.get("messages") or []
        results = [m.get("content", "") for m in messages if m.get("role") == "tool"]
        if not results:
            return Reply.tool_calls_of(calls)
        return Reply.text(" | ".join(str(r) for r in results))

    return script


def tool_results(rows: Any) -> dict[str, dict[str, Any]]:
    """The tool_result rows of a transcript, by tool name, parsed."""
    return {
        r.payload["name"]: json.loads(r.payload["content"]) for r in rows if r.kind == "tool_result"
    }


# Every MCP server the tests start (the test scripts beside this file, and the time server).
def tool_pass(server: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One pass against the fake model that calls `server`'s tool `name` once with `arguments`,
    then answers; returns that tool's result row (the pass must end with a final answer)."""
    with FakeOpenAIServer(script=calls_then_answer((name, arguments))) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        out = run_session_loop(
            Session.from_user_message("go"),
            Session.from_agent_prompt("Use the tools."),
            agent_provider=provider,
            tools=server.tools(),
        )
        out.synchronize(timeout=GUARD_SECONDS * 4)
        assert out.stop_reason == "final_answer"
        return tool_results(out.rows)[name]


_SERVER_SCRIPTS = ("mcp_sdk_server.py", "mcp_raw_server.py", "mcp_server_time")


def _children() -> dict[int, str]:
    """Descendant processes of this process running an MCP test server: pid -> command line."""
    me = os.getpid()
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if fields and fields[0] == "Z":  # a zombie is already dead, only not reaped
            continue
        parents[int(entry)] = int(fields[1])
        commands[int(entry)] = cmdline
    found: dict[int, str] = {}
    for pid, cmd in commands.items():
        if not any(script in cmd for script in _SERVER_SCRIPTS):
            continue
        if "mcp/reaper.py" in cmd:  # the supervisor a stdio server runs under, not the server
            continue
        ancestor = parents.get(pid)
        for _ in range(8):
            if ancestor == me:
                found[pid] = cmd
                break
            if ancestor is None:
                break
            ancestor = parents.get(ancestor)
    return found


def server_children(settle_seconds: float = 0.0, expect: set[int] | None = None) -> dict[int, str]:
    """Our live MCP server children, waiting up to `settle_seconds` until they are the `expect`ed
    pids (default: none)."""
    deadline = time.monotonic() + settle_seconds
    while True:
        found = _children()
        if found.keys() == (expect or set()) or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """True while `pid` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def gone(pid: int, settle_seconds: float = GUARD_SECONDS) -> bool:
    """True once `pid` is no longer running, waiting up to `settle_seconds` (an exiting process
    lingers a moment after its command line is already gone)."""
    deadline = time.monotonic() + settle_seconds
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@contextmanager
def http_server(*extra: str) -> Iterator[str]:
    """The SDK test server over streamable HTTP on 127.0.0.1; yields its MCP URL."""
    proc = subprocess.Popen(
        [sys.executable, SERVER_SCRIPT, "--http", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"the HTTP test server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(GUARD_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
