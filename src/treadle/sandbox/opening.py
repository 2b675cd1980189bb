"""`Sandbox`: an opened placement, and the opener the session layer's `SandboxHandle` calls.

`treadle.session.SandboxHandle` counts the sessions sharing a placement; this module opens the
placement's backend on first use and closes it when the count reaches zero. A close is safe from
any thread, from a finaliser and at interpreter exit; on a thread running an event loop it is
handed to a separate thread so the loop never waits on `rmtree`.
This module must never block an event loop and never open a backend before it is used.
"""

from __future__ import annotations

import asyncio
import atexit
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from treadle.errors import ConfigurationError
from treadle.runtime.threads import run_internal_io
from treadle.sandbox import removal
from treadle.sandbox.backend import Backend, CommandResult, DirEntry, FileContent
from treadle.sandbox.placements import PlacementLike, backend_for
from treadle.session.ports import install_opener, install_preparer

__all__ = ["Sandbox", "open_placement", "prepare_placement"]

_closers: set[threading.Thread] = set()
_closers_lock = threading.Lock()


#: Seconds a close handed off at exit still gets to finish (kill the box, drop its cgroup).
_HAND_OFF_WAIT_SECONDS = 5.0


def _join_closers() -> None:
    """At exit, let background closes finish for `EXIT_WAIT_SECONDS` in all; then the workspace
    removals still running hand their trees to a detached process (`treadle.sandbox.removal`)."""
    with _closers_lock:
        pending = list(_closers)
    deadline = time.monotonic() + removal.EXIT_WAIT_SECONDS
    for thread in pending:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in pending) and removal.stop_removals():
        for thread in pending:  # each stops within one batch of unlinks, then hands off
            thread.join(timeout=_HAND_OFF_WAIT_SECONDS)


atexit.register(_join_closers)


def _on_event_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _close_in_background(backend: Backend, on_closed: Callable[[], None]) -> None:
    def close() -> None:
        try:
            backend.close()
        finally:
            on_closed()
            with _closers_lock:
                _closers.discard(threading.current_thread())

    thread = threading.Thread(target=close, name="treadle-sandbox-close", daemon=True)
    with _closers_lock:
        _closers.add(thread)
    try:
        thread.start()
    except RuntimeError:  # interpreter shutting down: no new threads, close right here
        with _closers_lock:
            _closers.discard(thread)
        close()


class Sandbox:
    """An opened sandbox: its `backend`, `workspace` root and async operations on it."""

    __slots__ = ("backend",)
    __treadle_inject__: ClassVar[str] = "sandbox"  # a tool parameter of this type gets it

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def workspace(self) -> Path:
        """The workspace root directory."""
        return self.backend.workspace

    async def run_command(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (reported)
    ) -> CommandResult:
        """Run a shell command in the workspace (own process group, scrubbed env, capped output).

        `timeout` defaults to the backend's; when it passes, the whole process group is killed.
        """
        return await self.backend.run_command(command, timeout=timeout)

    async def read_file(self, path: str) -> FileContent:
        """Read a workspace file (`PathViolation` when `path` leaves the workspace)."""
        return await self.backend.read_file(path)

    async def write_file(self, path: str, data: str | bytes) -> int:
        """Write a workspace file (text is UTF-8 encoded); return the number of bytes written."""
        raw = data.encode() if isinstance(data, str) else data
        return await self.backend.write_file(path, raw)

    async def list_files(self, path: str = ".") -> list[DirEntry]:
        """List a workspace directory, sorted by name."""
        return await self.backend.list_files(path)

    def close_soon(self, on_closed: Callable[[], None]) -> None:
        """Close the backend; on an event loop's thread the close runs on a separate thread.

        `on_closed` is called when the close finished (on whichever thread ran it). At
        interpreter exit, or on a thread without a loop, the close runs right here.
        """
        if _on_event_loop_thread() and not sys.is_finalizing():
            _close_in_background(self.backend, on_closed)
            return
        try:
            self.backend.close()
        finally:
            on_closed()

    async def aclose(self) -> None:
        """Close the backend on a worker thread."""
        await run_internal_io(self.backend.close)

    def __repr__(self) -> str:
        return f"<Sandbox {self.backend.name} {self.backend.workspace}>"


def prepare_placement(placement: PlacementLike, backend: object | None = None) -> Backend:
    """The unopened backend of `placement` (or the given one, checked): the session layer's
    preparer, run when a session binds a placement."""
    if backend is None:
        return backend_for(placement)
    # Checked on the class: a protocol isinstance would read properties that need an open backend.
    if not all(callable(getattr(type(backend), m, None)) for m in ("open", "close")):
        raise ConfigurationError(
            f"backend must implement treadle.sandbox.Backend, got {type(backend).__name__}."
        )
    return backend  # type: ignore[return-value]


def open_placement(placement: PlacementLike, backend: object | None = None) -> Sandbox:
    """Open `placement` (or its prepared `backend`): the session layer's opener."""
    opened = prepare_placement(placement, backend)
    opened.open()
    return Sandbox(opened)


install_opener(open_placement)
install_preparer(prepare_placement)
