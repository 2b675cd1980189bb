"""No stdio MCP server process outlives `aclose`: not a grandchild that left the server's process
group with `setsid()` (after a double fork, ignoring SIGTERM), not a server that ignores SIGTERM.

The server runs under `treadle.mcp.reaper` (the init of a PID namespace, or a child subreaper):
orphans are re-parented to it and it kills every descendant when the server is closed.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from mcp_helpers import GUARD_SECONDS, SERVER_SCRIPT, alive, gone, server_children
from treadle.errors import MCPServerError
from treadle.mcp import MCPServer
from treadle.runtime import get_runtime

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the subreaper is Linux-only")


def _wait_for_pid(path: Path) -> int:
    """The pid the escaped grandchild wrote (it writes after its double fork)."""
    import time

    deadline = time.monotonic() + GUARD_SECONDS
    while not path.exists():
        assert time.monotonic() < deadline, "the grandchild never wrote its pid"
        time.sleep(0.02)
    return int(path.read_text())


def _session_id(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[-1].split()[3])


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_setsid_grandchild_does_not_outlive_aclose(tmp_path: Path, ignore_term: bool) -> None:
    pid_file = tmp_path / "grandchild.pid"
    extra = ["--ignore-term"] if ignore_term else []
    server = MCPServer.stdio(
        sys.executable,
        [SERVER_SCRIPT, "--escape", str(pid_file), *extra],
        stderr=subprocess.DEVNULL,
    )
    try:
        server.tools()
        result = get_runtime().run(server.call("pid", {}), timeout=GUARD_SECONDS)
        server_pid = result.structured_content["result"]
        grandchild = _wait_for_pid(pid_file)
        assert alive(grandchild)
        # It really left: its own session, not the server's group.
        assert _session_id(grandchild) != _session_id(server_pid)
    finally:
        server.close()
    assert gone(server_pid)
    assert gone(grandchild)
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_the_supervisor_passes_the_servers_exit_code_and_reaps_its_orphans(
    tmp_path: Path,
) -> None:
    # The supervisor alone, as a script: an orphan left behind by a command that exits is
    # killed before the supervisor exits, and the command's code comes back.
    reaper = Path(__import__("treadle.mcp.reaper").mcp.reaper.__file__)
    pid_file = tmp_path / "orphan.pid"
    script = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    open({str(pid_file)!r}, 'w').write(os.readlink('/proc/self'))\n"
        "    time.sleep(3600)\n"
        "time.sleep(0.2)\n"
        "sys.exit(7)\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(reaper), sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=GUARD_SECONDS,
    )
    assert done.returncode == 7, done.stderr
    assert gone(int(pid_file.read_text()))


def test_a_missing_command_under_the_supervisor_says_so() -> None:
    reaper = Path(__import__("treadle.mcp.reaper").mcp.reaper.__file__)
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(reaper), "/nonexistent/server"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    assert done.returncode == 127
    assert "could not run /nonexistent/server" in done.stderr


def test_a_server_that_never_answers_is_stopped_without_the_exit_grace() -> None:
    # It reads nothing and says nothing: the start times out, and closing goes straight to
    # SIGTERM rather than first waiting for it to exit on its own (which would add seconds
    # past the timeout the caller asked for).
    silent = MCPServer.stdio(
        sys.executable, ["-c", "import time; time.sleep(3600)"], connect_timeout=0.5
    )
    with pytest.raises(MCPServerError, match="TimeoutError"):
        silent.tools()
    link = silent._link
    silent.close()
    assert link is not None and link.stop_phases == [("SIGTERM",)]
    polite = MCPServer.stdio(sys.executable, [SERVER_SCRIPT], stderr=subprocess.DEVNULL)
    polite.tools()
    link = polite._link
    polite.close()
    assert link is not None and link.stop_phases == [("stdin",)]  # it exited on its own


def test_the_cli_counts_loading_the_sdk_against_the_mcp_timeout() -> None:
    from treadle.cli.mcp_tools import _LEAST_SECONDS, close_servers, open_servers

    async def opened() -> list[float]:
        command = shlex.join([sys.executable, SERVER_SCRIPT])
        servers, _ = await open_servers([command], [], connect_timeout=GUARD_SECONDS)
        await close_servers(servers)
        return [s.limits.connect_timeout for s in servers]

    (given,) = asyncio.run(opened())
    assert _LEAST_SECONDS <= given <= GUARD_SECONDS


def test_the_cli_says_the_wait_it_gave_not_the_time_stopping_took() -> None:
    # A server that neither answers nor stops on SIGTERM: stopping it takes seconds past the
    # timeout, which the message must not count as time it was given to answer.
    import re

    from treadle.cli.failures import CliFailure
    from treadle.cli.mcp_tools import open_servers

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    command = shlex.join([sys.executable, "-c", stubborn])
    with pytest.raises(CliFailure) as failed:
        asyncio.run(open_servers([command], [], connect_timeout=0.5))
    said = re.search(
        r"no answer within (\d+\.\d) s(?: \((\d+\.\d) s of it loading)?", str(failed.value)
    )
    assert said is not None, failed.value
    loading = float(said.group(2) or 0.0)
    # Rounded figures of loading + the 0.5 s granted (stopping took 2 s more: SIGTERM ignored).
    assert abs(float(said.group(1)) - loading - 0.5) <= 0.15, failed.value


def test_the_no_server_left_check_sees_every_test_server() -> None:
    # The checks that no server outlives its test must see the raw server too, or they pass
    # for it whatever happens.
    raw = str(Path(__file__).with_name("mcp_raw_server.py"))
    server = MCPServer.stdio(sys.executable, [raw], stderr=subprocess.DEVNULL)
    try:
        server.tools()
        assert any("mcp_raw_server.py" in cmd for cmd in server_children().values())
    finally:
        server.close()
    assert server_children(settle_seconds=GUARD_SECONDS) == {}


def test_closing_during_a_listing_stops_its_compiles_and_the_listing_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # close() waited for every compile of a hostile listing (7.7 s), and the tools() it
    # interrupted then returned that listing, from a closed server
    import threading

    from treadle.mcp.listing import compile_all as real

    raw = str(Path(__file__).with_name("mcp_raw_server.py"))
    compiling, outcome = threading.Event(), dict[str, Any]()

    def compile_all(listing: Any, label: str, closed: Callable[[], bool]) -> Any:
        def closed_once_told() -> bool:
            if not compiling.is_set():  # the first question waits for the close (bounded)
                compiling.set()
                for _ in range(int(GUARD_SECONDS * 100)):
                    if closed():
                        break
                    threading.Event().wait(0.01)
            return closed()

        try:
            outcome["compiled"] = real(listing, label, closed_once_told)
        except MCPServerError as error:
            outcome["compiled"] = error
            raise
        return outcome["compiled"]

    monkeypatch.setattr("treadle.mcp.link.compile_all", compile_all)
    server = MCPServer.stdio(sys.executable, [raw, "--tools", "999"], stderr=subprocess.DEVNULL)

    def listing() -> None:
        try:
            outcome["tools"] = server.tools()
        except MCPServerError as error:
            outcome["tools"] = error

    lister = threading.Thread(target=listing)
    lister.start()
    assert compiling.wait(GUARD_SECONDS)
    server.close()
    lister.join(GUARD_SECONDS)
    assert not lister.is_alive()
    assert "closed while its tools were listed" in str(outcome["compiled"]), outcome
    assert isinstance(outcome["tools"], MCPServerError), outcome
    assert "closed" in str(outcome["tools"]), outcome
    assert server_children(settle_seconds=GUARD_SECONDS) == {}
