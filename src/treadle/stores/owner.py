"""Who runs a pass a store records as `running`, and whether that process is still alive.

A running pass records its owner (host name, pid, a start id: the kernel's boot id with the
process's start time, so a recycled pid is not mistaken for the owner, and its pid namespace: the
boot id with the inode of `/proc/self/ns/pid`) in its pass record. Pids mean something only
inside one pid namespace: containers may share a host name (Kubernetes `hostNetwork` pods, a
shared UTS namespace) yet each number their own processes. So only an owner in this process's
pid namespace is looked up by pid: it is alive while its pid exists with the same start id;
anywhere else (another host, or the same host name in another pid namespace) the
pass's last write (`updated_at`) is a lease that holds for the owner's lease seconds (recorded with
it: `OWNER_LEASE_SECONDS`, or `TREADLE_OWNER_LEASE_SECONDS` in the owner's environment). The owner
renews the lease (a heartbeat every third of it) while the pass runs, so a long pass stays owned
for as long as its process lives, and a dead owner's lease runs out. A pass whose owner is alive
is listed by `Store.pending()` as not resumable and a takeover of it is refused.

Inside the owner's own process the pid says nothing about one pass: a pass cancelled, or a resume
cancelled while its takeover was in flight, may leave a record `running` that nothing in the
process runs any more. So this process keeps the passes it runs in `LIVE` (by pass id, while
their journal lives: a pass registers when it first records, a resume while it takes a pass
over), and a record it owns is alive only while its pass id is there.
"""

from __future__ import annotations

import asyncio
import os
import socket
import weakref
from collections.abc import Mapping
from functools import cache
from typing import Any

__all__ = [
    "LIVE",
    "OWNER_LEASE_SECONDS",
    "Running",
    "lease_seconds",
    "owner_alive",
    "runs_here",
    "this_owner",
]


class Running:
    """What `LIVE` holds for a pass this process runs: the event loop that runs it (a pass whose
    loop has closed is not run any more, whatever still references it)."""

    __slots__ = ("__weakref__", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop


#: The passes this process runs on a stored conversation, by pass id (held by the pass's
#: journal, or by a resume while it takes the pass over): weak, so a pass whose coroutine was
#: dropped without ending leaves with its journal.
LIVE: weakref.WeakValueDictionary[str, Running] = weakref.WeakValueDictionary()


def runs_here(pass_id: str) -> bool:
    """True while this process runs pass `pass_id` (in `LIVE`, on a loop not closed)."""
    held = LIVE.get(pass_id)
    return held is not None and not held.loop.is_closed()


#: How long a running pass recorded on another host counts as owned after its last write (or
#: heartbeat) by default.
OWNER_LEASE_SECONDS = 600.0
#: The environment variable that sets this process's lease (seconds) instead.
LEASE_ENV = "TREADLE_OWNER_LEASE_SECONDS"


def lease_seconds() -> float:
    """This process's lease: `TREADLE_OWNER_LEASE_SECONDS` when it is a positive number, else
    `OWNER_LEASE_SECONDS`."""
    try:
        value = float(os.environ.get(LEASE_ENV, ""))
    except ValueError:
        return OWNER_LEASE_SECONDS
    return value if 0 < value < float("inf") else OWNER_LEASE_SECONDS


def _start_id(pid: int) -> str | None:
    """Boot id and start time of process `pid` (None where /proc does not tell)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


@cache
def _host() -> str:
    return socket.gethostname()


@cache
def _pid_namespace() -> str | None:
    """This process's pid namespace: boot id and the namespace's inode (None without /proc)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        inode = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}:{inode}"


def this_owner() -> dict[str, Any]:
    """The owner record of this process."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": _host(),
        "pidns": _pid_namespace(),
        "start": _start_id(pid),
        "lease": lease_seconds(),
    }


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    except (OverflowError, OSError):  # no process can have it (a pid past the C int's range)
        return False
    return True


def owner_alive(
    metadata: object, updated_at: float, now: float, pass_id: str | None = None
) -> bool:
    """True when the owner recorded in a running pass's `metadata` may still run it (given the
    pass's id, an owner that is this process runs it only while the pass is in `LIVE`)."""
    owner = metadata.get("owner") if isinstance(metadata, Mapping) else None
    if not isinstance(owner, Mapping):
        return False  # recorded before owners were: resumable, as before
    pid, host, start = owner.get("pid"), owner.get("host"), owner.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    # An owner recorded before namespaces were (no "pidns") is judged by pid on its host, as
    # then; one whose namespace is unknown on either side is judged by its lease.
    elsewhere = "pidns" in owner and (owner["pidns"] is None or owner["pidns"] != _pid_namespace())
    if host != _host() or elsewhere:
        lease = owner.get("lease")
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease > 0:
            lease = OWNER_LEASE_SECONDS  # recorded before leases were
        return now - updated_at < lease
    if pid == os.getpid():
        if start != _start_id(pid):
            return False
        return pass_id is None or runs_here(pass_id)
    if not _pid_exists(pid):
        return False
    return start is None or _start_id(pid) in (None, start)
