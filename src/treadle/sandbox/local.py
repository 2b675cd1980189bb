"""`LocalBackend`: a sandbox on this machine, in a temporary or user-given directory.

The workspace is a fresh temporary directory (deleted on close) or a directory the user named
(never deleted). File operations are confined to it (see `treadle.sandbox.paths`) and run on the
sandbox I/O threads; commands run as subprocesses in their own process groups with a scrubbed
environment (see `treadle.sandbox.process`). This is confinement of paths and processes, not a
security boundary: commands can still reach the rest of the machine. This module must never block
the event loop and never delete a directory it did not create.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from treadle.errors import PathViolation, SandboxError
from treadle.sandbox.backend import CommandResult, DirEntry, FileContent
from treadle.sandbox.beneath import is_link_error, make_dirs_beneath, open_beneath, opened
from treadle.sandbox.environment import DEFAULT_ENV_ALLOW, scrubbed_environment
from treadle.sandbox.paths import workspace_parts
from treadle.sandbox.process import (
    DEFAULT_COMMAND_TIMEOUT,
    MAX_STREAM_BYTES,
    kill_process_group,
    run_command,
)
from treadle.sandbox.removal import remove_workspace
from treadle.tools.threads import LoopThreadLimiter

__all__ = ["MAX_LIST_ENTRIES", "MAX_READ_BYTES", "SANDBOX_IO_THREADS", "LocalBackend"]

#: Threads per event loop for sandbox file I/O (separate from the sync-tool threads).
SANDBOX_IO_THREADS = 16
#: Bytes read from a file at most (the result says how big the file really is).
MAX_READ_BYTES = 256 * 1024
#: Directory entries listed at most.
MAX_LIST_ENTRIES = 1_000

_IO = LoopThreadLimiter(SANDBOX_IO_THREADS)


class LocalBackend:
    """A sandbox in a local directory: `placement` is `"local"` (temporary) or a directory path."""

    name = "local"

    def __init__(
        self,
        placement: str = "local",
        *,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        max_output_bytes: int = MAX_STREAM_BYTES,
        env_allow: Iterable[str] = DEFAULT_ENV_ALLOW,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.placement = placement
        self.command_timeout = command_timeout
        self.max_output_bytes = max_output_bytes
        self.env_allow = tuple(env_allow)
        self.extra_env = dict(extra_env or {})
        self._root: Path | None = None
        self._owns_root = placement == "local"
        self._closed = False
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._owner_pid = os.getpid()

    @property
    def workspace(self) -> Path:
        """The workspace root (a real, absolute path)."""
        if self._root is None:
            raise SandboxError("the sandbox is not open yet; call open() first.")
        return self._root

    @property
    def closed(self) -> bool:
        """True once `close` ran."""
        return self._closed

    def open(self) -> Path:
        """Create the temporary workspace (or check the given directory) and return its root."""
        with self._lock:
            if self._closed:
                raise SandboxError("this sandbox is closed; bind a new one with session.to(...).")
            if self._root is None:
                if self._owns_root:
                    self._root = Path(os.path.realpath(tempfile.mkdtemp(prefix="treadle-")))
                else:
                    root = Path(os.path.realpath(os.path.expanduser(self.placement)))
                    if not root.is_dir():
                        raise SandboxError(
                            f"sandbox directory {self.placement!r} does not exist; create it "
                            "first or use session.to('local') for a temporary one."
                        )
                    self._root = root
            return self._root

    def close(self) -> None:
        """Kill running commands, then delete the workspace if it is temporary; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            groups, self._groups = set(self._groups), set()
        if self._owner_pid != os.getpid():
            return  # a forked child's copy: the workspace and commands are the parent's
        for pgid in groups:
            self._kill(pgid)
        self._wait_killed(groups)
        if self._owns_root and self._root is not None:
            remove_workspace(self._root)

    def _wait_killed(self, groups: set[int]) -> None:
        """Before the workspace goes, wait for the killed `groups` to exit (the isolated backend
        does; here the group's processes have no handle to wait on)."""

    def _live_root(self) -> Path:
        if self._closed:
            raise SandboxError("this sandbox is closed; bind a new one with session.to(...).")
        return self.workspace

    # -- commands -----------------------------------------------------------------------------
    def _started(self, pgid: int) -> bool:
        """Register group `pgid` as running; False (and the group killed) when the sandbox was
        closed first: that close did not know the command, so it is reported as never run."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._groups.add(pgid)
        if closed:  # closed while the command was starting
            self._kill(pgid)
        return not closed

    def _exited(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)

    def _kill(self, pgid: int) -> None:
        """SIGKILL command group `pgid` (the isolated backend stops its box's init first)."""
        kill_process_group(pgid)

    async def run_command(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (reported)
    ) -> CommandResult:
        """Run `command` with `/bin/sh -c` in the workspace; `timeout` defaults per backend."""
        root = self._live_root()
        env = scrubbed_environment(allow=self.env_allow, extra=self.extra_env)
        return await self._run_tracked(command, root, env, timeout)

    async def _run_tracked(
        self,
        command: str,
        root: Path,
        env: Mapping[str, str],
        timeout: float | None,  # noqa: ASYNC109 (reported)
        launcher: Sequence[str] = (),
        group: list[int] | None = None,
    ) -> CommandResult:
        """`run_command` with this backend's start, exit and kill hooks (the group id appended
        to `group`); a command its sandbox's close raced at its start raises
        `_closed_at_start` instead of a raw OS error or what it printed from a removed
        workspace."""
        late: list[int] = []

        def started(pgid: int) -> None:
            if group is not None:
                group.append(pgid)
            if not self._started(pgid):
                late.append(pgid)

        try:
            result = await run_command(
                command,
                cwd=root,
                env=env,
                timeout=self.command_timeout if timeout is None else timeout,
                max_bytes=self.max_output_bytes,
                on_start=started,
                on_exit=self._exited,
                launcher=launcher,
                kill=self._kill,
            )
        except OSError:
            if self._closed:  # the close removed the workspace, the command's cwd
                raise self._closed_at_start() from None
            raise
        if late:
            # Killed at once and reaped: its output (bubblewrap's, the memory group's or the
            # shell's word on the removed workspace) is not the command's, so it is not kept.
            raise self._closed_at_start()
        return result

    def _closed_at_start(self) -> SandboxError:
        """The error of a command whose sandbox was closed while it was starting (the start
        failed on the removed workspace, or the close came before the command was registered
        as running): the same error as a command on a closed sandbox, not a raw OS error."""
        return SandboxError(
            "this sandbox was closed while the command was starting, so the command was "
            "stopped and nothing it printed is kept; bind a new one with session.to(...)."
        )

    # -- files ------------------------------------------------------------------------------------
    async def read_file(self, path: str) -> FileContent:
        """The first `MAX_READ_BYTES` of a workspace file."""
        root = self._live_root()
        return await _IO.run(_read, root, path)

    async def write_file(self, path: str, data: bytes) -> int:
        """Create or replace a workspace file (parent directories are created)."""
        root = self._live_root()
        return await _IO.run(_write, root, path, data)

    async def list_files(self, path: str = ".") -> list[DirEntry]:
        """The entries of a workspace directory, sorted by name (at most `MAX_LIST_ENTRIES`)."""
        root = self._live_root()
        return await _IO.run(_list, root, path)


def _link_refused(path: str) -> PathViolation:
    return PathViolation(
        f"the path {path!r} is or passes through a symbolic link; the file tools never follow "
        "links in a workspace, so use the path the link points to."
    )


def _open_in(root: Path, path: str, parts: tuple[str, ...], flags: int) -> int:
    """`parts` opened below `root`'s fd (no link followed); tool-shaped errors."""
    with opened(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)) as root_fd:
        try:
            return open_beneath(root_fd, parts, flags)
        except OSError as e:
            if is_link_error(e):
                raise _link_refused(path) from None
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise SandboxError(
                    f"no file {path!r} in the workspace; list the files first."
                ) from None
            if e.errno in (errno.EACCES, errno.EPERM):  # the isolated backend acts as the box
                raise SandboxError(f"no permission to open {path!r}.") from None
            raise SandboxError(f"cannot open {path!r} ({e.strerror}).") from None


def _read(root: Path, path: str) -> FileContent:
    parts = workspace_parts(root, path)
    fd = _open_in(root, path, parts, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SandboxError(f"{path!r} is a directory; list it instead of reading it.")
        if not stat.S_ISREG(info.st_mode):
            raise SandboxError(f"{path!r} is not a regular file.")
        if info.st_nlink > 1:
            # A hard link shares its data with another name, possibly outside the workspace.
            raise PathViolation(
                f"{path!r} has other hard links, possibly outside the workspace; not read."
            )
        chunks: list[bytes] = []
        remaining = MAX_READ_BYTES
        while remaining > 0:
            chunk = os.read(fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return FileContent("/".join(parts) or ".", data, max(info.st_size, len(data)))


def _write(root: Path, path: str, data: bytes) -> int:
    if not path or not path.strip():
        raise PathViolation("the path is empty; name a file inside the workspace.")
    parts = workspace_parts(root, path)
    if not parts:
        raise SandboxError("cannot write to the workspace root; name a file inside it.")
    with opened(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)) as root_fd:
        try:
            parent = make_dirs_beneath(root_fd, parts[:-1])
        except OSError as e:
            if is_link_error(e):
                raise _link_refused(path) from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise SandboxError(
                    f"no permission to write {path!r}; choose another file."
                ) from None
            raise SandboxError(f"cannot make the directories of {path!r} ({e.strerror}).") from None
    # O_NOFOLLOW on one name relative to the held parent: a link there is refused (ELOOP).
    # O_NONBLOCK: opening a FIFO without a reader would otherwise block this thread for good.
    # No O_TRUNC yet: what the path names is checked first (see below).
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with opened(parent):
        try:
            fd = os.open(parts[-1], flags, 0o644, dir_fd=parent)
        except IsADirectoryError:
            raise SandboxError(f"{path!r} is a directory; choose a file name.") from None
        except PermissionError:  # the isolated backend writes with the box's rights
            raise SandboxError(f"no permission to write {path!r}; choose another file.") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(path) from None
            # ENXIO: a FIFO nobody reads
            raise SandboxError(f"{path!r} is not a regular file ({e.strerror}).") from None
    with os.fdopen(fd, "wb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SandboxError(f"{path!r} is not a regular file.")
        if info.st_nlink > 1:
            # A hard link shares its data with another name, possibly outside the workspace.
            raise PathViolation(
                f"{path!r} has other hard links, which may be outside the workspace; write a new "
                "file instead."
            )
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        handle.write(data)
    return len(data)


def _entry_type(entry: os.DirEntry[str]) -> Literal["file", "directory", "symlink", "other"]:
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "directory"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


def _list(root: Path, path: str) -> list[DirEntry]:
    parts = workspace_parts(root, path)
    try:
        fd = _open_in(root, path, parts, os.O_RDONLY | os.O_NONBLOCK)
    except SandboxError as e:
        if isinstance(e, PathViolation) or "no file" not in str(e):
            raise
        raise SandboxError(f"no directory {path!r} in the workspace.") from None
    with opened(fd):
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise SandboxError(f"{path!r} is a file; read it instead of listing it.")
        entries = []
        with os.scandir(fd) as it:
            for entry in it:
                kind = _entry_type(entry)
                size = entry.stat(follow_symlinks=False).st_size if kind == "file" else 0
                entries.append(DirEntry(entry.name, kind, size))
    entries.sort(key=lambda e: e.name)
    return entries[:MAX_LIST_ENTRIES]
