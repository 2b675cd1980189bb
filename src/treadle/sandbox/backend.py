"""The `Backend` protocol every sandbox implements, and the values its operations return.

A backend owns one workspace: it opens it (cheaply), runs commands in it, reads, writes and lists
files confined to it, and closes it. `treadle.session.SandboxHandle` shares one backend between
sessions by reference count. This module holds only definitions: it must never do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

__all__ = ["Backend", "CommandResult", "DirEntry", "FileContent"]


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What a finished (or killed) command left behind."""

    exit_code: int | None
    """The exit status; negative for a signal (-9 when killed); None if it never exited."""
    stdout: str
    """Standard output (UTF-8, undecodable bytes replaced), capped with a truncation marker."""
    stderr: str
    """Standard error, capped the same way."""
    elapsed_ms: int
    """Wall time from start to the end of the output, in milliseconds."""
    timed_out: bool = False
    """True when the timeout killed the command's process group."""


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing."""

    name: str
    """The entry's name inside the listed directory."""
    type: Literal["file", "directory", "symlink", "other"]
    """What the entry is (symlinks are not followed)."""
    size: int
    """Size in bytes (0 for directories)."""


@dataclass(frozen=True, slots=True)
class FileContent:
    """The start of a file's bytes."""

    path: str
    """The path relative to the workspace root."""
    data: bytes
    """The bytes read (at most the backend's read cap)."""
    size: int
    """The file's full size in bytes."""

    @property
    def truncated(self) -> bool:
        """True when the file is longer than `data`."""
        return self.size > len(self.data)


@runtime_checkable
class Backend(Protocol):
    """A sandbox implementation. `open` and `close` are sync and safe from any thread."""

    name: str
    """The backend's name (`"local"`)."""

    @property
    def workspace(self) -> Path:
        """The workspace root (valid once opened)."""
        ...

    def open(self) -> Path:
        """Create or attach the workspace and return its root; cheap (no subprocesses)."""
        ...

    def close(self) -> None:
        """Kill running commands and release the workspace; idempotent, blocking, any thread."""
        ...

    async def run_command(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (reported)
    ) -> CommandResult:
        """Run a shell command in the workspace (its own process group, scrubbed environment)."""
        ...

    async def read_file(self, path: str) -> FileContent:
        """Read a file inside the workspace; `PathViolation` for a path that leaves it."""
        ...

    async def write_file(self, path: str, data: bytes) -> int:
        """Write (create or replace) a file inside the workspace; return the bytes written."""
        ...

    async def list_files(self, path: str = ".") -> list[DirEntry]:
        """List a directory inside the workspace, sorted by name."""
        ...
