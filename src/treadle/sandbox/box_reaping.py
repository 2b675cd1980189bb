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
orphan the shell (a zombie again, of root's, until the machine's init reaps it). Before the
monitor exists (a kill within a millisecond or so of the start) the init itself is killed, and
`unshare` reaps it with the garbled status above: `kill_box` says which it did, and the backend
reports a command it killed (its timeout, its close) as exit -9 either way. The processes are
found through pidfds, so a pid reused meanwhile is never signalled; once `unshare` has been
reaped nothing of the command is left, and nothing is signalled by its old number. The shell's
own notices ("Killed" when its child dies by a signal) go to /dev/null: stderr holds the
command's output only.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from pathlib import Path

from treadle.sandbox.process import kill_process_group

__all__ = ["UNSHARE_NOTICE", "kill_box", "open_leader", "reaped_argv", "wait_exited"]

# $0: the memory group's procs file ("" for none); "$@": what runs as the shell's child, in a
# subshell that gets the shell's stderr back (fd 3): the shell's own notices go to /dev/null (a
# simple command's redirections would be the shell's too while it waits and says "Killed").
_INIT_SCRIPT = (
    '[ -z "$0" ] || echo 0 > "$0" || exit; exec 3>&2 2>/dev/null; (exec "$@" 2>&3 3>&-); exit $?'
)
#: The line `unshare` writes when the namespace init it waited for died by a signal (2.38).
UNSHARE_NOTICE = "unshare: "


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


def kill_box(pgid: int, leader: int | None) -> bool:
    """SIGKILL the box of command group `pgid` so that nothing it ran is left unreaped.

    With `leader` (the pidfd of `unshare`, the group's leader) not yet reaped, bubblewrap's
    monitor (the child of `unshare`'s child), or before it exists that child itself, is killed,
    and the rest ends by itself: True. Once `leader` was reaped nothing of the command is left
    and nothing is signalled. Without a pidfd, or before `unshare` forked, the whole group.
    """
    if leader is None:
        kill_process_group(pgid)
        return False
    if not _unreaped(leader):
        return False
    killed = False
    for init, init_fd in _children(pgid, leader):
        try:
            monitors = _children(init, init_fd)
            for _, monitor_fd in monitors:
                try:
                    _kill(monitor_fd)
                finally:
                    os.close(monitor_fd)
            if not monitors:  # not forked yet: the init goes, `unshare` reaps it
                _kill(init_fd)
            killed = True
        finally:
            os.close(init_fd)
    if not killed:  # `unshare` has not forked yet: it is the group's only process
        kill_process_group(pgid)
    return killed


def wait_exited(leaders: list[int], seconds: float) -> None:
    """Wait up to `seconds` until the processes of pidfds `leaders` (`unshare`s whose boxes were
    killed) have exited: `unshare` exits only after its namespace init, and the kernel ends every
    process of the namespace before that init's exit completes, so nothing of the box runs then.
    An exited, unreaped `unshare` counts (its reaping is its command's own task's job)."""
    poller = select.poll()
    for pidfd in leaders:
        poller.register(pidfd, select.POLLIN)  # readable once the process exited
    pending = len(leaders)
    deadline = time.monotonic() + seconds
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for pidfd, _ in poller.poll(left * 1000):
            poller.unregister(pidfd)
            pending -= 1


def _kill(pidfd: int) -> None:
    with contextlib.suppress(OSError):  # reaped meanwhile: its parent goes on as after a kill
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)


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
