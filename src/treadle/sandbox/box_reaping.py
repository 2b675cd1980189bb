"""Every process of an isolated command is reaped before the command is reported done.

bubblewrap's monitor (the process that starts the box) exits as soon as the box's PID 1 reports
the command's status, without waiting for that PID 1: an orphan, the machine's init reaps it.
An init that reaps late (a firecracker or container init under load) or never (a Python app
that is PID 1 in a container) keeps a zombie a command, and zombies count in the box uid's
`RLIMIT_NPROC`: after about `max_processes` commands the box could not fork at all ("bwrap:
Can't fork for pid 1: Resource temporarily unavailable").

As root, each command therefore starts under `unshare --pid --fork`, with a shell as the init of
a PID namespace of its own: it joins the box's memory group, runs the rest (the box's uid through
`setpriv`, its limits through `prlimit`, then bubblewrap) as its child and exits with that
child's status. When it exits the kernel kills and reaps everything left in the namespace (the
box's PID 1 among them) before `unshare`, Treadle's child, exits. The shell is there for the
status: `unshare` 2.38 turns a child's death by a signal into exit 1 and a line on stderr
("sigprocmask unblock failed"); a shell turns it into 128 + the signal, as bubblewrap does.

A kill (a timeout, a cancellation, the sandbox's close) stops bubblewrap's monitor, the shell's
child, and lets the shell and `unshare` end as above; killing the whole group at once would
orphan the shell (a zombie again, of root's, until the machine's init reaps it). `kill_box`
finds the monitor through pidfds, so a pid reused meanwhile is never signalled, and kills the
whole group when there is no monitor yet or any more.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from treadle.sandbox.process import kill_process_group

__all__ = ["kill_box", "open_leader", "reaped_argv"]

# $0: the memory group's procs file ("" for none); "$@": what runs as the shell's child.
_INIT_SCRIPT = '[ -z "$0" ] || echo 0 > "$0" || exit; "$@"; exit $?'


def reaped_argv(unshare: str, setpriv: str, uid: int, join: Path | None) -> list[str]:
    """The argv prefix (run as root) that starts the rest as `uid` under a namespace init.

    `join`: the memory group's procs file, which the init moves itself into first (as root:
    only root may move a process in cgroup v2), so the box's processes are all in the group.
    """
    return [
        unshare, "--pid", "--fork", "--kill-child",
        "/bin/sh", "-c", _INIT_SCRIPT, "" if join is None else str(join),
        setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
    ]  # fmt: skip


def open_leader(pid: int) -> int | None:
    """A pidfd of the command's first process (`unshare`), opened right after its start, while it
    is Treadle's unreaped child: later, that pid may belong to another process. None when the
    process is already gone (it failed at once) or the system has no pidfds."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def kill_box(pgid: int, leader: int | None) -> None:
    """SIGKILL the box of command group `pgid` so that nothing it ran is left unreaped.

    With `leader` (the pidfd of `unshare`, the group's leader) not yet reaped, bubblewrap's
    monitor (the child of `unshare`'s child) is killed and the rest ends by itself. Otherwise,
    or when there is no monitor, the whole group is killed, as for a command outside a box.
    """
    if leader is None or not _kill_grandchildren(pgid, leader):
        kill_process_group(pgid)


def _kill_grandchildren(pid: int, pidfd: int) -> bool:
    """SIGKILL the children of `pid`'s children; False when there were none."""
    killed = False
    for init, init_fd in _children(pid, pidfd):
        try:
            for _, monitor_fd in _children(init, init_fd):
                try:
                    signal.pidfd_send_signal(monitor_fd, signal.SIGKILL)
                    killed = True
                except OSError:  # exited meanwhile: its status is on its way
                    killed = True
                finally:
                    os.close(monitor_fd)
        finally:
            os.close(init_fd)
    return killed


def _children(pid: int, pidfd: int) -> list[tuple[int, int]]:
    """Pids and pidfds of the children of `pid` (whose pidfd is `pidfd`); empty once `pid` has
    been reaped (its number may name another process by then).

    Each pidfd holds its process from the moment it is opened; its parent is checked after
    that, so a pid that was reused since the listing (with another parent) is left out.
    """
    if not _unreaped(pidfd):  # the usual case after a command ended: nothing to list
        return []
    listed = _listed_children(pid)
    if not _unreaped(pidfd):
        return []
    found = []
    for child in listed:
        try:
            child_fd = os.pidfd_open(child)
        except OSError:  # gone since the listing
            continue
        if _parent_of(child) == pid and _unreaped(pidfd):
            found.append((child, child_fd))
        else:
            os.close(child_fd)
    return found


def _unreaped(pidfd: int) -> bool:
    """True while the process of `pidfd` has not been reaped (a zombie still answers)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except OSError:
        return False
    return True


def _listed_children(pid: int) -> list[int]:
    """The pids of `pid`'s children: its `/proc` children list, or a scan where there is none."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}/task/{pid}"):
            return []  # gone
    except OSError:
        return []
    # A kernel without CONFIG_PROC_CHILDREN: every process's parent (a kill's rare path only).
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _parent_of(int(e)) == pid]


def _parent_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
        # The command name in parentheses may hold anything: the fields follow its last ")".
        return int(f.read().rpartition(")")[2].split()[1])
    return None
