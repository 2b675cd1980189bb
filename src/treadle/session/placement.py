"""`SandboxHandle`: a sandbox placement shared by reference count, as a value of this layer.

Sessions share a handle: `session.to(...)` creates it, every derived session `acquire`s it and
releases its share when closed or garbage collected. The handle only counts: opening a placement
(and closing it at zero) is the sandbox layer's job, reached through the opener in
`treadle.session.ports` (`import treadle` installs it without importing the sandbox). This module
does no I/O and starts no thread.

A handle belongs to the process that created it: in a forked child it never opens, and releasing
it there (a finalizer at the child's exit) drops the child's count without closing anything, so a
child never deletes its parent's workspace or kills its parent's commands.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from treadle.errors import ConfigurationError, SandboxError
from treadle.session import ports

if TYPE_CHECKING:
    from treadle.sandbox import Sandbox

__all__ = ["OpenedSandbox", "PlacementOptions", "SandboxHandle"]


class PlacementOptions(Protocol):
    """A placement given as options (the sandbox layer's `Isolated(...)`): its name is recorded,
    and its options travel as plain data (`to_spec`) to saved files and distributed workers."""

    placement: ClassVar[str]

    def to_spec(self) -> dict[str, Any]:
        """The options as plain JSON data (the sandbox layer's `from_spec` reverses it)."""
        ...


class OpenedSandbox(Protocol):
    """What the sandbox layer hands back for an opened placement."""

    def close_soon(self, on_closed: Callable[[], None]) -> None:
        """Close without blocking an event loop; call `on_closed` when done (any thread)."""
        ...

    async def aclose(self) -> None:
        """Close, awaiting the work on a worker thread."""
        ...


class SandboxHandle:
    """A reference-counted share of one sandbox; the sandbox opens on first use.

    Starts with one reference (the creator's). `placement` is `"local"` (a fresh temporary
    directory, deleted on close), another backend name, or a directory path (used as is, never
    deleted). `backend` hands in a ready backend object to open instead of the placement's.
    """

    __slots__ = (
        "_backend",
        "_closed",
        "_done",
        "_lock",
        "_owner_pid",
        "_refcount",
        "_requested",
        "_sandbox",
        "placement",
    )

    def __init__(self, placement: str | PlacementOptions, *, backend: object | None = None) -> None:
        name = placement if isinstance(placement, str) else getattr(placement, "placement", None)
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                "placement must be 'local', 'isolated', an Isolated(...) value or a directory "
                "path, e.g. session.to('local')."
            )
        self.placement = name
        """Where the sandbox lives: `"local"`, `"isolated"`, or a directory path."""
        self._requested = placement  # the options value, when one was given, for the opener
        prepare = ports.preparer()
        # Built now (cheap, unopened), so a placement that cannot work fails at `.to(...)`.
        self._backend = prepare(placement, backend) if prepare is not None else backend
        self._sandbox: OpenedSandbox | None = None
        self._refcount = 1
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._owner_pid = os.getpid()

    @property
    def owner_pid(self) -> int:
        """The process this sandbox belongs to (a forked child never opens or closes it)."""
        return self._owner_pid

    def _foreign(self) -> bool:
        return self._owner_pid != os.getpid()

    @property
    def refcount(self) -> int:
        """Live references."""
        return self._refcount

    @property
    def closed(self) -> bool:
        """True once the count reached zero (the sandbox is closed or closing)."""
        return self._closed

    @property
    def opened(self) -> bool:
        """True once the sandbox was opened."""
        return self._sandbox is not None

    @property
    def sandbox(self) -> Sandbox | None:
        """The opened sandbox, or None before first use."""
        return self._sandbox  # type: ignore[return-value]

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
        """The sandbox, opening it on first use (cheap); thread-safe."""
        with self._lock:
            if self._closed:
                raise SandboxError(
                    "this sandbox is already closed; bind a new one with session.to(...)."
                )
            if self._foreign():
                raise SandboxError(
                    f"this sandbox belongs to process {self._owner_pid}; a forked child cannot "
                    "use its parent's sandbox. Bind a new one in the child with session.to(...)."
                )
            if self._sandbox is None:
                open_placement = ports.opener()
                if open_placement is None:
                    raise ConfigurationError(
                        "no sandbox layer is loaded to open this placement; import treadle."
                    )
                self._sandbox = open_placement(self._requested, self._backend)
            return self._sandbox  # type: ignore[return-value]

    def _drop(self) -> OpenedSandbox | None:
        """Drop one reference; the sandbox to close when it was the last (else None)."""
        with self._lock:
            if self._refcount <= 0:
                return None  # over-release (e.g. a finaliser after a manual close): ignore
            self._refcount -= 1
            if self._refcount > 0:
                return None
            self._closed = True
            opened = self._sandbox
        if self._foreign():  # the parent's sandbox: the parent closes it, never a forked child
            opened = None
        if opened is None:
            self._done.set()
        return opened

    def release(self) -> None:
        """Drop one reference; at zero the sandbox closes. Safe from any thread.

        The close never blocks an event loop: the sandbox layer moves it off the loop's thread.
        """
        opened = self._drop()
        if opened is not None:
            opened.close_soon(self._done.set)

    async def arelease(self) -> None:
        """Drop one reference; at zero, await the close on a worker thread."""
        opened = self._drop()
        if opened is None:
            return
        try:
            await opened.aclose()
        finally:
            self._done.set()

    def options_spec(self) -> dict[str, Any] | None:
        """The placement's options as plain data (`Isolated(...).to_spec()`, env values
        included), or None when the placement was given as a name or a directory."""
        requested = self._requested
        return None if isinstance(requested, str) else requested.to_spec()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until a close started by `release` finished; False on timeout."""
        return self._done.wait(timeout)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self.opened else "unopened")
        return f"<SandboxHandle {self.placement!r} refs={self._refcount} {state}>"
