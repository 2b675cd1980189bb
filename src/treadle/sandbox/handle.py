"""`SandboxHandle`: one sandbox shared by reference count; `Sandbox`: the opened sandbox.

Sessions share a handle: `session.to(...)` creates it, every derived session `acquire`s it and
releases its share when closed or garbage collected (through a `weakref.finalize`). The backend
opens lazily on first use and closes when the count reaches zero. `release` is safe from any
thread, from a finaliser and at interpreter exit; on a thread running an event loop it hands the
(blocking) close to a separate thread so the loop never waits on `rmtree`.
This module must never block an event loop and never open a backend before it is used.
"""

from __future__ import annotations

import asyncio
import atexit
import sys
import threading
from pathlib import Path

import anyio.to_thread

from treadle.errors import SandboxError
from treadle.sandbox.backend import Backend, CommandResult, DirEntry, FileContent
from treadle.sandbox.placements import PlacementLike, backend_for, placement_name

__all__ = ["Sandbox", "SandboxHandle"]

_closers: set[threading.Thread] = set()
_closers_lock = threading.Lock()


def _join_closers() -> None:
    """At exit, let background closes finish so temporary workspaces are deleted."""
    with _closers_lock:
        pending = list(_closers)
    for thread in pending:
        thread.join(timeout=5)


atexit.register(_join_closers)


def _on_event_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _close_in_background(backend: Backend, done: threading.Event) -> None:
    def close() -> None:
        try:
            backend.close()
        finally:
            done.set()
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

    def __repr__(self) -> str:
        return f"<Sandbox {self.backend.name} {self.backend.workspace}>"


class SandboxHandle:
    """A reference-counted share of one sandbox; the backend opens on first use.

    Starts with one reference (the creator's). `placement` is `"local"` (a fresh temporary
    directory, deleted on close), a directory path (used as is, never deleted), or `"isolated"`
    / an `Isolated(...)` value (a temporary workspace whose commands run in a bubblewrap box).
    """

    __slots__ = ("_backend", "_closed", "_done", "_lock", "_refcount", "_sandbox", "placement")

    def __init__(self, placement: PlacementLike, *, backend: Backend | None = None) -> None:
        self.placement = placement_name(placement)
        """Where the sandbox lives: `"local"`, `"isolated"` or a directory path."""
        self._backend: Backend = backend if backend is not None else backend_for(placement)
        self._sandbox: Sandbox | None = None
        self._refcount = 1
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Event()

    @property
    def refcount(self) -> int:
        """Live references."""
        return self._refcount

    @property
    def closed(self) -> bool:
        """True once the count reached zero (the backend is closed or closing)."""
        return self._closed

    @property
    def opened(self) -> bool:
        """True once the backend was opened."""
        return self._sandbox is not None

    @property
    def sandbox(self) -> Sandbox | None:
        """The opened sandbox, or None before first use."""
        return self._sandbox

    def acquire(self) -> SandboxHandle:
        """Take one more reference; `SandboxError` once closed."""
        with self._lock:
            if self._closed:
                raise SandboxError(
                    "this sandbox is already closed; bind a new one with session.to(...)."
                )
            self._refcount += 1
        return self

    def open(self) -> Sandbox:
        """The sandbox, opening the backend on first use (cheap); thread-safe."""
        with self._lock:
            if self._closed:
                raise SandboxError(
                    "this sandbox is already closed; bind a new one with session.to(...)."
                )
            if self._sandbox is None:
                self._backend.open()
                self._sandbox = Sandbox(self._backend)
            return self._sandbox

    def _drop(self) -> Backend | None:
        """Drop one reference; the backend to close when it was the last (else None)."""
        with self._lock:
            if self._refcount <= 0:
                return None  # over-release (e.g. a finaliser after a manual close): ignore
            self._refcount -= 1
            if self._refcount > 0:
                return None
            self._closed = True
            opened = self._sandbox is not None
        if not opened:
            self._done.set()
            return None
        return self._backend

    def release(self) -> None:
        """Drop one reference; at zero the backend closes. Safe from any thread.

        On a thread running an event loop the close runs on a separate thread; at interpreter
        exit (or anywhere else) it runs right here.
        """
        backend = self._drop()
        if backend is None:
            return
        if _on_event_loop_thread() and not sys.is_finalizing():
            _close_in_background(backend, self._done)
        else:
            try:
                backend.close()
            finally:
                self._done.set()

    async def arelease(self) -> None:
        """Drop one reference; at zero, await the backend close on a worker thread."""
        backend = self._drop()
        if backend is None:
            return
        try:
            await anyio.to_thread.run_sync(backend.close)
        finally:
            self._done.set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until a close started by `release` finished; False on timeout."""
        return self._done.wait(timeout)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self.opened else "unopened")
        return f"<SandboxHandle {self.placement!r} refs={self._refcount} {state}>"
