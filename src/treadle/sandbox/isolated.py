"""`IsolatedBackend`: the `local` backend's workspace and tools, with every command in a box.

The workspace is a fresh temporary directory, as for `local`, and the file tools run on the host
with the same path confinement; only commands differ: each runs in a bubblewrap box (see
`treadle.sandbox.bwrap`) that sees the read-only system, the workspace and a private `/tmp`, none
of the host's environment, processes or (by default) network. As root, each sandbox gets a host
uid of its own (from `BOX_UID_BASE`), so its process limit counts only its own processes and a
box escape lands as an unprivileged user; the workspace belongs to that uid, and the file tools
act as it too (the thread's file-system uid), so a command that swaps a directory for a link
while a tool runs gains nothing the box could not do itself. This module must never block the
event loop, never run a command outside a box, and never touch a box's files with root's powers
(except `claim`, which never follows a link).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from treadle.errors import SandboxError, SandboxUnavailable
from treadle.sandbox.backend import CommandResult, DirEntry, FileContent
from treadle.sandbox.box_reaping import (
    UNSHARE_NOTICE,
    kill_box,
    open_leader,
    reaped_argv,
    wait_exited,
)
from treadle.sandbox.box_tree import give_tree_to
from treadle.sandbox.bwrap import (
    BOX_ENV,
    BWRAP_INSTALL_HINT,
    Isolated,
    box_command,
    find_executable,
)
from treadle.sandbox.local import _IO, LocalBackend, _list, _read, _write
from treadle.sandbox.memory_group import MemoryGroup, make_memory_group
from treadle.sandbox.process import (
    DEFAULT_COMMAND_TIMEOUT,
    MAX_STREAM_BYTES,
    kill_process_group,
)

__all__ = ["BOX_UID_BASE", "BOX_UID_COUNT", "IsolatedBackend"]

#: Seconds a close waits for the boxes it killed to exit before it deletes their workspace.
_KILLED_EXIT_WAIT_SECONDS = 2.0
#: First host uid handed to boxes when Treadle runs as root (no passwd entry needed).
BOX_UID_BASE = 2_100_000_000
#: How many uids boxes cycle through (sandboxes open at once in one process never share one).
BOX_UID_COUNT = 1_000_000

_next_uid = itertools.count()
log = logging.getLogger("treadle.sandbox")
_ASK = 0xFFFFFFFF  # setfsuid((uid_t)-1) changes nothing and returns the current value
T = TypeVar("T")


@functools.cache
def _libc() -> Any:
    import ctypes  # only as root, on the first file operation

    return ctypes.CDLL(None, use_errno=True)


def _as_uid(uid: int, operation: Callable[..., T], *args: object) -> T:
    """`operation(*args)` on this thread with file-system uid and gid `uid`.

    Linux keeps the file-system ids per thread, and changing them from 0 drops the thread's file
    capabilities (CAP_DAC_OVERRIDE, CAP_CHOWN, ...) until they are set back.
    """
    libc = _libc()
    old_gid = libc.setfsgid(uid)
    old_uid = libc.setfsuid(uid)
    try:
        if libc.setfsuid(_ASK) != uid or libc.setfsgid(_ASK) != uid:
            raise SandboxError("could not switch to the box's uid for a file operation.")
        return operation(*args)
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)


#: bwrap executables already asked whether they take `--size` (a sized tmpfs): path -> answer.
_SIZES_TMPFS: dict[str, bool] = {}


async def _takes_size(bwrap: str) -> bool:
    """True when `bwrap --help` lists `--size` (bubblewrap 0.8 and later); asked once per path."""
    known = _SIZES_TMPFS.get(bwrap)
    if known is None:
        try:
            helped = await anyio.run_process([bwrap, "--help"], check=False)
            known = b"--size" in helped.stdout + helped.stderr
        except OSError:
            known = False
        _SIZES_TMPFS[bwrap] = known
    return known


_warned_memory = False


def _warn_memory_once(bound: str) -> None:
    """Say once per process that `memory_bytes` is a per-process limit here (and why)."""
    global _warned_memory
    if not _warned_memory:
        _warned_memory = True
        log.warning("treadle: the isolated box's memory_bytes is %s", bound)


def _as_killed(result: CommandResult) -> CommandResult:
    """`result` of a command whose box Treadle killed (its timeout, the sandbox's close): exit -9
    as on `local`, whichever status the box's namespace init or `unshare` reported for the
    kill, without the line `unshare` writes when it reaps an init killed before it started
    bubblewrap (see `treadle.sandbox.box_reaping`)."""
    stderr = result.stderr
    head, _, last = stderr.rstrip("\n").rpartition("\n")
    if last.startswith(UNSHARE_NOTICE):
        stderr = head + "\n" if head else ""
    return dataclasses.replace(result, exit_code=-signal.SIGKILL, stderr=stderr)


def _allocate_uid() -> int:
    # Spread by pid so two Treadle processes on one machine rarely share a uid.
    return BOX_UID_BASE + (os.getpid() * 7919 + next(_next_uid)) % BOX_UID_COUNT


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except FileNotFoundError:
                pass
    return count


class IsolatedBackend(LocalBackend):
    """A sandbox whose commands run in a bubblewrap box; `SandboxUnavailable` without `bwrap`."""

    name = "isolated"

    def __init__(
        self,
        options: Isolated | None = None,
        *,
        command_timeout: float | None = DEFAULT_COMMAND_TIMEOUT,
        max_output_bytes: int = MAX_STREAM_BYTES,
    ) -> None:
        # Checked here, at `session.to("isolated")`, not at the first command of a pass.
        self._bwrap = find_executable("bwrap")
        self._prlimit = find_executable("prlimit")
        super().__init__(
            "local", command_timeout=command_timeout, max_output_bytes=max_output_bytes
        )
        self.placement = "isolated"
        self.options = options if options is not None else Isolated()
        self._own_uid = os.geteuid() == 0
        self.host_uid = _allocate_uid() if self._own_uid else os.geteuid()
        """The host uid every process of this box runs as."""
        # As root, each command's box is started in a PID namespace of its own, which reaps it
        # whole (see `treadle.sandbox.box_reaping`); pidfds of the running commands' first
        # processes, by group, let a kill stop that namespace's init alone.
        self._tools = [self._bwrap, self._prlimit]
        if self._own_uid:
            self._unshare = find_executable("unshare")
            self._setpriv = find_executable("setpriv")
            self._tools += [self._unshare, self._setpriv]
        self._leaders: dict[int, int | None] = {}  # None: no pidfd (no descriptor to spare)
        self._killed: set[int] = set()  # groups whose box `_kill` stopped (their status: -9)
        self._env = {**BOX_ENV, **self.options.env}
        self._memory: MemoryGroup | None = None
        self.memory_bound: str | None = None
        """How `limits.memory_bytes` is enforced, in words, once the box is open: a cgroup (v2
        or v1) for all its processes together, or "per process only" and why (see
        docs/sandbox.md); None before `open` or without a memory limit."""

    def open(self) -> Path:
        """Create the temporary workspace and hand it to the box's uid; return its root.

        Where the machine lets it (cgroup v2 with the memory controller delegated, or v1 as
        root), the box also gets a memory cgroup of `limits.memory_bytes` for all its processes
        together (see `treadle.sandbox.memory_group`); `memory_bound` says which, or why not.
        """
        root = super().open()
        if self._own_uid:
            os.chown(root, self.host_uid, self.host_uid)
        limit = self.options.limits.memory_bytes
        if limit is not None and self._memory is None and self.memory_bound is None:
            self._memory, self.memory_bound = make_memory_group(root.name, limit, self.host_uid)
            if self._memory is None:
                _warn_memory_once(self.memory_bound)
        return root

    def close(self) -> None:
        """Kill running commands, delete the workspace and remove the memory cgroup."""
        try:
            super().close()
        finally:  # a workspace that could not be deleted still releases its memory group
            if self._memory is not None and self._owner_pid == os.getpid():
                self._memory.close()

    def _started(self, pgid: int) -> bool:
        if self._own_uid:  # before the group is known as live: a close may kill it at once
            leader = open_leader(pgid)
            with self._lock:
                self._leaders[pgid] = leader
        return super()._started(pgid)

    def _exited(self, pgid: int) -> None:
        super()._exited(pgid)
        with self._lock:
            leader = self._leaders.pop(pgid, None)
        if leader is not None:
            os.close(leader)

    def _wait_killed(self, groups: set[int]) -> None:
        # A killed box can still run for a moment (its PID 1 goes when the namespace init
        # does): one still setting up would find the workspace gone and report bubblewrap's
        # error as the command's stderr, and one still writing could leave files behind.
        with self._lock:  # copies: `_exited` may close the originals meanwhile
            leaders = [os.dup(fd) for g in groups if (fd := self._leaders.get(g)) is not None]
        try:
            wait_exited(leaders, _KILLED_EXIT_WAIT_SECONDS)
        finally:
            for fd in leaders:
                os.close(fd)

    def _kill(self, pgid: int) -> None:
        # Under the lock: `_exited` (another thread, for a close) may not close the pidfd while
        # it is used here.
        with self._lock:
            if not self._own_uid:
                kill_process_group(pgid)
            elif pgid in self._leaders and kill_box(pgid, self._leaders[pgid]):
                self._killed.add(pgid)
            # Not in `_leaders`: the command ended and was reaped (a close that listed it just
            # before): its number may be another group's by now, so nothing is signalled.

    @property
    def memory_group(self) -> MemoryGroup | None:
        """The box's memory cgroup, or None where the machine gives none (see docs/sandbox.md)."""
        return self._memory

    async def run_command(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (reported)
    ) -> CommandResult:
        """Run `command` with `/bin/sh -c` in a fresh box over the workspace (at `/workspace`)."""
        root = self._live_root()
        for tool in self._tools:
            if not os.access(tool, os.X_OK):  # removed (or upgraded away) since the box was made
                raise SandboxUnavailable(
                    f"{tool} is gone since this sandbox was made; reinstall it "
                    f"({BWRAP_INSTALL_HINT if tool == self._bwrap else 'package util-linux'})."
                )
        if self.options.limits.tmp_bytes is not None and not await _takes_size(self._bwrap):
            raise SandboxUnavailable(
                f"{self._bwrap} has no --size option (bubblewrap before 0.8), so the box's /tmp "
                "and /dev/shm cannot be bounded; upgrade bubblewrap, or pass "
                "ResourceLimits(tmp_bytes=None) to accept unbounded RAM-backed mounts."
            )
        launcher = box_command(
            self.options,
            workspace=root,
            bwrap=self._bwrap,
            prlimit=self._prlimit,
            processes_already=0 if self._own_uid else _processes_of(self.host_uid),
        )
        memory = self._memory
        oom_before = 0 if memory is None else memory.oom_kills()
        if self._own_uid:  # starts as root, joins the memory group, then becomes the box's uid
            join = None if memory is None else memory.procs_file
            launcher = [*reaped_argv(self._unshare, self._setpriv, self.host_uid, join), *launcher]
        elif memory is not None:
            launcher = [*memory.join_argv(), *launcher]
        group: list[int] = []
        try:
            result = await self._run_tracked(command, root, self._env, timeout, launcher, group)
        finally:
            with self._lock:
                killed = bool(group) and group[0] in self._killed
                self._killed.difference_update(group)
        if killed:
            result = _as_killed(result)
        # The kernel's OOM killer may kill the shell (137) or bwrap itself (-9).
        killed = result.exit_code in (128 + signal.SIGKILL, -signal.SIGKILL)
        if memory is not None and killed and memory.oom_kills() > oom_before:
            note = (
                "\n[treadle: the command was stopped by the box's memory limit "
                f"({memory.limit} bytes for all its processes, memfd and tmpfs included)]"
            )
            return dataclasses.replace(result, stderr=result.stderr + note)
        return self._explained(result)

    def _explained(self, result: CommandResult) -> CommandResult:
        """`result`, with a line on stderr saying which limit stopped it (if one did)."""
        code = result.exit_code
        if code in (126, 127) and not result.stdout and "failed to execute" in result.stderr:
            # prlimit could not start bwrap (removed between the check above and the start)
            raise SandboxUnavailable(
                f"bubblewrap could not be started ({result.stderr.strip()}); {BWRAP_INSTALL_HINT}."
            )
        limits = self.options.limits
        # bwrap's own failures (before the command starts) are exit 1 with "bwrap: ..." alone.
        bwrap_failed = code == 1 and not result.stdout and result.stderr.startswith("bwrap: ")
        if bwrap_failed and "Resource temporarily unavailable" in result.stderr:
            # EAGAIN from fork: the uid's process limit is reached, by the sandbox's other
            # commands running at once (they share it), not a machine that cannot make boxes.
            note = (
                "\n[treadle: the box could not start a process: its process limit "
                f"(max_processes={limits.max_processes}) counts the sandbox's other running "
                "commands too, or the machine has no process to spare]"
            )
            return dataclasses.replace(result, stderr=result.stderr + note)
        if bwrap_failed:
            raise SandboxUnavailable(
                f"bubblewrap could not build the box ({result.stderr.strip()}); it needs "
                "unprivileged user namespaces (on Ubuntu 24.04+ an AppArmor profile for bwrap), "
                "and the box's uid must be able to reach the workspace (TMPDIR) and every extra "
                "mount."
            )
        # bubblewrap reports a command killed by signal N as exit status 128 + N.
        notes = {
            128 + signal.SIGXCPU: f"CPU-time limit ({limits.cpu_seconds} s)",
            128 + signal.SIGXFSZ: f"file-size limit ({limits.file_size_bytes} bytes)",
        }
        if code not in notes:
            return result
        note = f"\n[treadle: the command was stopped by the box's {notes[code]}]"
        return dataclasses.replace(result, stderr=result.stderr + note)

    async def _as_box(self, operation: Callable[..., T], *args: object) -> T:
        root = self._live_root()
        if not self._own_uid:  # the box runs as this user already
            return await _IO.run(operation, root, *args)
        return await _IO.run(_as_uid, self.host_uid, operation, root, *args)

    async def read_file(self, path: str) -> FileContent:
        """The first `MAX_READ_BYTES` of a workspace file, read with the box's rights."""
        return await self._as_box(_read, path)

    async def write_file(self, path: str, data: bytes) -> int:
        """Create or replace a workspace file as the box's uid (so its commands can change it)."""
        return await self._as_box(_write, path, data)

    async def list_files(self, path: str = ".") -> list[DirEntry]:
        """The entries of a workspace directory, listed with the box's rights."""
        return await self._as_box(_list, path)

    async def claim(self) -> None:
        """Hand everything in the workspace to the box's uid (after files were put in by hand)."""
        if self._own_uid:
            await _IO.run(give_tree_to, self._live_root(), self.host_uid)
