"""`treadle run --mcp "command args"` and `--mcp-url URL`, run as subprocesses against the fake
model server and the SDK test server (stdio and streamable HTTP)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from mcp_helpers import SERVER_SCRIPT, calls_then_answer, http_server, server_children
from test_cli import _env, treadle
from treadle.testing import FakeOpenAIServer

_STDIO = shlex.join([sys.executable, SERVER_SCRIPT])


def _messages_of(proc: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert proc.returncode == 0, proc.stderr
    messages: list[dict[str, object]] = json.loads(proc.stdout)["messages"]
    return messages


def _run(fake: FakeOpenAIServer, cwd: Path, *servers: str) -> subprocess.CompletedProcess[str]:
    return treadle(
        "run", "add and echo", "--model", "fake-model", "--base-url", fake.base_url, *servers,
        "--json", cwd=cwd, env=_env(),
    )  # fmt: skip


# One test per server setup (not one for all four), so xdist runs them side by side.
def test_tools_whose_names_collide_once_made_safe_are_refused(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as fake:
        # lists read.file and read_file
        proc = _run(fake, tmp_path, "--mcp", f"{sys.executable} {SERVER_SCRIPT} --collide")
        assert proc.returncode == 2
        assert "'read.file' and 'read_file'" in proc.stderr
        assert fake.request_count == 0
    assert server_children() == {}


def test_two_servers_listing_one_name_are_refused(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as fake, http_server() as url:
        proc = _run(fake, tmp_path, "--mcp", _STDIO, "--mcp-url", url)
        # both servers list `add`: a clear error before any model request
        assert proc.returncode == 2, proc.stderr
        assert "two tools are named 'add'" in proc.stderr and "prefix" in proc.stderr
        assert fake.request_count == 0
    assert server_children() == {}


def test_run_with_a_stdio_server(tmp_path: Path) -> None:
    script = calls_then_answer(("add", {"a": 40, "b": 2}), ("echo", {"text": "echoed"}))
    with FakeOpenAIServer(script=script) as fake:
        proc = _run(fake, tmp_path, "--mcp", _STDIO)
        tools = [m for m in _messages_of(proc) if m["role"] == "tool"]
        assert json.loads(str(tools[0]["content"]))["structured"] == {"result": 42}
        assert json.loads(str(tools[1]["content"]))["structured"] == {"result": "echoed"}
        sent = {t["function"]["name"] for t in fake.requests[0].body["tools"]}
        assert {"add", "echo", "hang"} <= sent
    assert server_children() == {}


def test_run_with_an_http_server(tmp_path: Path) -> None:
    script = calls_then_answer(("add", {"a": 40, "b": 2}), ("echo", {"text": "echoed"}))
    with FakeOpenAIServer(script=script) as fake, http_server() as url:
        proc = _run(fake, tmp_path, "--mcp-url", url)
        tools = [m for m in _messages_of(proc) if m["role"] == "tool"]
        assert json.loads(str(tools[0]["content"]))["structured"] == {"result": 42}
    assert server_children() == {}


def test_a_server_that_cannot_start_is_a_usage_error(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as fake:
        proc = treadle(
            "run",
            "hi",
            "--model",
            "fake-model",
            "--base-url",
            fake.base_url,
            "--mcp",
            "/nonexistent/server --flag",
            cwd=tmp_path,
            env=_env(),
        )
        assert proc.returncode == 2
        # a program that is not there is named before anything starts (no raw child line)
        assert "--mcp '/nonexistent/server --flag': there is no file /nonexistent/server" in (
            proc.stderr
        )
        assert "could not run" not in proc.stderr
        proc = treadle(
            "run", "hi", "--model", "fake-model", "--base-url", fake.base_url,
            "--mcp", "no-such-cmd-xyz", cwd=tmp_path, env=_env(),
        )  # fmt: skip
        assert proc.returncode == 2
        assert "--mcp 'no-such-cmd-xyz': no program named 'no-such-cmd-xyz' on PATH" in proc.stderr
        assert "fix: install it, or pass its full path" in proc.stderr
        # a program that runs but exits at once: it could not start as a server
        quit_at_once = f"{sys.executable} -c pass"
        proc = treadle(
            "run", "hi", "--model", "fake-model", "--base-url", fake.base_url,
            "--mcp", quit_at_once, cwd=tmp_path, env=_env(),
        )  # fmt: skip
        assert proc.returncode == 2
        assert f"could not start MCP server {quit_at_once}" in proc.stderr
        assert "check the --mcp command or --mcp-url" in proc.stderr
        assert fake.request_count == 0
