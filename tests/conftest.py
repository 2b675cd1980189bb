"""Shared fixtures. Tests talk to real parts: the runtime thread, real files, real subprocesses."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator

import anyio
import anyio.abc

# CPython 3.11 keeps one AST-construction depth counter per interpreter, not per thread
# (python/cpython#106905), so two threads building ASTs at once can raise a spurious
# "AST constructor recursion depth mismatch". Hypothesis's pytest plugin imports (and pytest
# rewrites) the hypothesis package lazily at the end of the session, while Treadle's runtime and
# worker threads may still be running; importing it here, before any thread starts, removes that
# window.
import hypothesis  # noqa: F401
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


@pytest.fixture(params=BACKENDS)
def any_sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """A fresh sandbox of each backend in turn."""
    yield from open_sandbox(request.param)


@pytest.fixture
def marker() -> str:
    """A `sleep` argument no other process on the machine uses: `sleep {marker}` sleeps 30 s and
    lets the test find every such process on the host, whichever PID namespace it is in."""
    return f"30.{uuid.uuid4().int % 10**12:012d}"


def processes_with(marker: str) -> list[int]:
    """Host pids of the live processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().split(") ", 1)[1][0] == "Z"
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if marker.encode() in cmdline and not zombie:
            found.append(int(entry))
    return found


@pytest.fixture
def survivors() -> Callable[[str], list[int]]:
    """`survivors(marker)`: host pids still running a command that contains `marker`."""
    return processes_with


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
