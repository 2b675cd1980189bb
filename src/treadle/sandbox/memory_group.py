"""A memory cgroup per box: every page the box's processes use counts, memfd and tmpfs included.

`RLIMIT_AS` bounds each process's address space, but not memory that outlives a mapping: a
memfd (or a file in the box's tmpfs `/tmp`, `/dev/shm`) holds its pages while an fd or a name
is left. A memory cgroup counts those too. `MemoryGroup.create` makes one below Treadle's own
cgroup when the machine lets it: cgroup v1's memory controller (`memory.limit_in_bytes`, and
`memory.memsw.limit_in_bytes` so swap does not stretch it), the hierarchy this machine has. The
box's first process joins it itself, before it starts bwrap (`join_argv`): the group's `tasks`
file is handed to the box's uid, which cgroup v1 allows to move its own processes.
cgroup v2 (`memory.max`) would need the move made by root from the common ancestor, and is not
done here: there, and without root, `create` returns None and `memory_bytes` stays a per-process
limit (docs/sandbox.md says so). This module must never write outside the group it made.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

__all__ = ["MemoryGroup"]

_V1_ROOT = Path("/sys/fs/cgroup/memory")
#: How long `close` waits for the kernel to let the emptied group go (killed processes exit).
_REMOVE_WAIT_SECONDS = 2.0


def _own_v1_group() -> Path | None:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _V1_ROOT / path.lstrip("/")
    return None


class MemoryGroup:
    """One box's memory cgroup (cgroup v1): its processes together stay under `limit` bytes."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        """The group's directory."""
        self.limit = limit
        """The bytes its processes may use together (memfd, tmpfs and page cache included)."""

    @classmethod
    def create(cls, name: str, limit: int, uid: int) -> MemoryGroup | None:
        """A new group `name` under this process's memory cgroup, joinable by `uid`; None when
        the machine has no writable cgroup v1 memory controller (no root, or cgroup v2 only)."""
        parent = _own_v1_group()
        if parent is None or not (parent / "memory.limit_in_bytes").exists():
            return None
        path = parent / name
        try:
            path.mkdir()
        except OSError:
            return None
        group = cls(path, limit)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # swap accounting on: swap counts against the same limit
                memsw.write_text(str(limit))
            os.chown(path / "tasks", uid, uid)
        except OSError:
            group.close()
            return None
        return group

    def join_argv(self) -> list[str]:
        """An argv prefix that moves the process into the group, then runs the rest."""
        # "0" into `tasks`: the writing thread itself (the shell has one). Moving one thread, and
        # the writer itself, skips the kernel's global threadgroup lock and its RCU wait, which
        # a move through `cgroup.procs` pays (about 5 ms a command here).
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', str(self.path / "tasks")]

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this group for going over the limit."""
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "memory.oom_control").read_text().splitlines():
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
