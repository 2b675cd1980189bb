"""Helpers for the sandbox tests of both backends (`test_sandbox_escape.py`,
`test_sandbox_isolated.py`): which backends run here, opening a sandbox, finding the processes a
command left behind whichever PID namespace they are in, and a loopback server to reach.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import anyio
import anyio.abc
import pytest

from treadle.sandbox import Isolated, IsolatedBackend, Sandbox, SandboxHandle

# On CI a missing bwrap is a failure (make install provides it), not a skip.
_NO_BWRAP = shutil.which("bwrap") is None and not os.environ.get("CI")
needs_bwrap = pytest.mark.skipif(
    _NO_BWRAP,
    reason="bwrap is not installed (package bubblewrap: `sudo apt-get install -y bubblewrap`, "
    "which `make install` runs where apt is available)",
)
BACKENDS = [pytest.param("local", id="local"), pytest.param("isolated", marks=needs_bwrap)]


def open_sandbox(placement: str | Isolated) -> Iterator[Sandbox]:
    """An opened sandbox for `placement`, released (and waited for) afterwards."""
    if isinstance(placement, Isolated):
        handle = SandboxHandle("isolated", backend=IsolatedBackend(placement))
    else:
        handle = SandboxHandle(placement)
    try:
        yield handle.open()
    finally:
        handle.release()
        handle.wait_closed(10)


def processes_with(marker: str) -> list[int]:
    """Host pids of the live processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read() and not is_zombie(entry):
                    found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return found


async def connect_from(sandbox: Sandbox) -> str:
    """Serve on 127.0.0.1 here and try to connect from a command in `sandbox`; its stdout."""

    async def greet(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.send(b"hi")

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, greet)
            result = await sandbox.run_command(
                "python3 -c \"import socket; s = socket.create_connection(('127.0.0.1', "
                f"{port}), timeout=5); print('connected', s.recv(2))\"",
                timeout=20,
            )
            group.cancel_scope.cancel()
    return result.stdout


def is_zombie(pid: str) -> bool:
    """True when process `pid` has exited and waits to be reaped (no longer running)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] == "Z"


def run_as_nobody(
    args: list[str], *, pythonpath: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`python *args` as uid and gid 65534 (nobody, through setpriv from root), importing from
    `pythonpath`; skips the test when nobody cannot read this checkout's virtualenv."""
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, *args],
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": pythonpath,
            "TMPDIR": "/tmp",
            "HOME": "/tmp",
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 and "Permission denied" in proc.stderr and ".venv" in proc.stderr:
        pytest.skip("uid nobody cannot read this checkout's virtualenv")
    return proc
