"""A memory cgroup per box: every page the box's processes use counts, memfd and tmpfs included.

`RLIMIT_AS` bounds each process's address space, but not memory that outlives a mapping: a
memfd (or a file in the box's tmpfs `/tmp`, `/dev/shm`) holds its pages while an fd or a name
is left. A memory cgroup counts those too. `make_memory_group` makes one below Treadle's own
cgroup, in whichever hierarchy has the memory controller:

- cgroup v2 (`memory.max`, and `memory.swap.max` 0 so swap does not stretch it), when Treadle's
  own cgroup delegates the memory controller to its children (`cgroup.subtree_control`; Treadle
  enables it there when it may). Moving a process needs write access to the common ancestor's
  `cgroup.procs`, which the box's uid does not have when Treadle runs as root; so there the
  box's first process joins the group as root and then becomes the box's uid (`setpriv`).
- cgroup v1 (`memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes`), where the group's
  `tasks` file is handed to the box's uid, which v1 allows to move its own processes.

Where neither works (no root and no delegated v2 subtree, or no memory controller at all),
it returns why, and `memory_bytes` stays a per-process limit (the backend's `memory_bound`
says so, and a warning is logged). This module must never write outside the group it made
(and its parent's `cgroup.subtree_control`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupLayout", "MemoryGroup", "make_memory_group"]

#: How long `close` waits for the kernel to let the emptied group go (killed processes exit).
_REMOVE_WAIT_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where this process's own cgroups are: in the cgroup2 mount, and in cgroup v1's memory
    hierarchy (None where the machine has no such mount)."""

    v2: Path | None
    v1_memory: Path | None

    @classmethod
    def of_this_process(cls) -> CgroupLayout:
        """From `/proc/self/mountinfo` and `/proc/self/cgroup` (hybrid machines have both)."""
        v2_mount = v1_mount = None
        try:
            with open("/proc/self/mountinfo") as f:
                mounts = f.read().splitlines()
            with open("/proc/self/cgroup") as f:
                memberships = f.read().splitlines()
        except OSError:
            return cls(None, None)
        for line in mounts:
            fields = line.split(" - ", 1)
            if len(fields) != 2:
                continue
            point = fields[0].split()[4]
            fs_type, _, options = fields[1].split()[:3]
            if fs_type == "cgroup2":
                v2_mount = Path(point)
            elif fs_type == "cgroup" and "memory" in options.split(","):
                v1_mount = Path(point)
        v2 = v1 = None
        for line in memberships:
            number, controllers, path = line.split(":", 2)
            relative = path.lstrip("/")
            if number == "0" and not controllers and v2_mount is not None:
                v2 = v2_mount / relative
            elif "memory" in controllers.split(",") and v1_mount is not None:
                v1 = v1_mount / relative
        return cls(v2, v1)


def _write(path: Path, value: str) -> None:
    # Never O_CREAT: a cgroup interface file the kernel did not make must not appear.
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


class MemoryGroup:
    """One box's memory cgroup: its processes together stay under `limit` bytes."""

    def __init__(self, path: Path, limit: int, version: int) -> None:
        self.path = path
        """The group's directory."""
        self.limit = limit
        """The bytes its processes may use together (memfd, tmpfs and page cache included)."""
        self.version = version
        """1 or 2: the cgroup hierarchy the group is in."""

    @classmethod
    def create(cls, name: str, limit: int, uid: int) -> MemoryGroup | None:
        """A new group `name` joinable by `uid`, or None (see `make_memory_group` for why)."""
        group, _ = make_memory_group(name, limit, uid)
        return group

    @property
    def procs_file(self) -> Path:
        """The file a process writes "0" into to move itself into the group.

        In v1, "0" into `tasks` moves only the writing thread (a shell has one), which skips the
        kernel's global threadgroup lock and its RCU wait that a move through `cgroup.procs`
        pays (about 5 ms a command here).
        """
        return self.path / ("tasks" if self.version == 1 else "cgroup.procs")

    def join_argv(self) -> list[str]:
        """An argv prefix that moves the process into the group, then runs the rest (as root,
        the box's namespace init joins it instead: see `treadle.sandbox.box_reaping`)."""
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', str(self.procs_file)]

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this group for going over the limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def close(self) -> None:
        """Remove the group (its processes were killed; the kernel lets it go once they exit)."""
        deadline = time.monotonic() + _REMOVE_WAIT_SECONDS
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # an empty group left behind is harmless; it goes with its parent
                time.sleep(0.02)  # dying processes are still being reaped


def _make_dir(path: Path) -> None:
    """mkdir in a cgroup file system: the kernel fills the new group with its interface files."""
    path.mkdir()


def _enable_memory(parent: Path) -> None:
    """Delegate the memory controller to `parent`'s children.

    The kernel refuses (EBUSY) while processes sit in `parent` itself (unless it is the root
    cgroup). When the only one there is Treadle's own process, it first moves itself into a
    leaf `treadle` below it, as systemd's delegation rules ask of a delegated service.
    """
    try:
        _write(parent / "cgroup.subtree_control", "+memory")
    except OSError as e:
        if e.errno != errno.EBUSY or _words(parent / "cgroup.procs") != [str(os.getpid())]:
            raise
        leaf = parent / "treadle"
        if not leaf.exists():
            _make_dir(leaf)
        _write(leaf / "cgroup.procs", str(os.getpid()))
        _write(parent / "cgroup.subtree_control", "+memory")


def _v2_group(parent: Path, name: str, limit: int, uid: int) -> MemoryGroup | str:
    if "memory" not in _words(parent / "cgroup.controllers"):
        return f"cgroup v2: the memory controller is not available in {parent}"
    if "memory" not in _words(parent / "cgroup.subtree_control"):
        try:
            _enable_memory(parent)
        except OSError as e:
            return (
                f"cgroup v2: {parent} does not delegate the memory controller to its children "
                f"and Treadle may not enable it ({e.strerror}); run Treadle in a cgroup with "
                "`memory` in cgroup.subtree_control (see docs/sandbox.md)"
            )
    path = parent / name
    try:
        _make_dir(path)
    except OSError as e:
        return f"cgroup v2: cannot make a group in {parent} ({e.strerror})"
    group = MemoryGroup(path, limit, 2)
    try:
        _write(path / "memory.max", str(limit))
        if (path / "memory.swap.max").exists():  # swap accounting on: no swap beyond the limit
            _write(path / "memory.swap.max", "0")
        if os.geteuid() != 0:  # a delegated subtree: the box runs as this user and moves itself
            os.chown(path / "cgroup.procs", uid, uid)
    except OSError as e:
        group.close()
        return f"cgroup v2: cannot set the limit in {path} ({e.strerror})"
    return group


def _v1_group(parent: Path, name: str, limit: int, uid: int) -> MemoryGroup | str:
    if os.geteuid() != 0 or not (parent / "memory.limit_in_bytes").exists():
        return f"cgroup v1: {parent} is not writable (Treadle does not run as root)"
    path = parent / name
    try:
        _make_dir(path)
    except OSError as e:
        return f"cgroup v1: cannot make a group in {parent} ({e.strerror})"
    group = MemoryGroup(path, limit, 1)
    try:
        _write(path / "memory.limit_in_bytes", str(limit))
        memsw = path / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # swap accounting on: swap counts against the same limit
            _write(memsw, str(limit))
        os.chown(path / "tasks", uid, uid)
    except OSError as e:
        group.close()
        return f"cgroup v1: cannot set the limit in {path} ({e.strerror})"
    return group


def make_memory_group(
    name: str, limit: int, uid: int, layout: CgroupLayout | None = None
) -> tuple[MemoryGroup | None, str]:
    """A memory group `name` of `limit` bytes that `uid`'s box can join, and how the box's
    memory is bounded; else None and why `memory_bytes` stays per process.

    cgroup v2 is tried first (the kernel's current interface), then v1's memory hierarchy.
    """
    layout = CgroupLayout.of_this_process() if layout is None else layout
    reasons: list[str] = []
    for version, parent in ((2, layout.v2), (1, layout.v1_memory)):
        if parent is None:
            continue
        made = (_v2_group if version == 2 else _v1_group)(parent, name, limit, uid)
        if isinstance(made, MemoryGroup):
            return made, f"cgroup v{version} memory group {made.path} ({limit} bytes in all)"
        reasons.append(made)
    if not reasons:
        reasons.append("no cgroup file system is mounted")
    return None, (
        f"per process only (RLIMIT_AS {limit} bytes; memfd and tmpfs pages not counted): "
        + "; ".join(reasons)
    )
