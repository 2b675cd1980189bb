"""A stdio MCP server's supervisor: run as `python reaper.py COMMAND ARGS...`, it starts the
server and, when the server exits or the supervisor is told to stop, kills every process the
server left behind, including ones that left its process group with `setsid()`.

Two ways of holding the server's process tree, the first that works on this machine:

- ``pidns`` (preferred): the supervisor unshares a new PID namespace (inside a new user namespace
  with an identity uid/gid map when it is not root, so the server still runs as the same user)
  and forks an *init* for it, which starts the server. Every descendant of the server lives in
  that namespace, and the kernel SIGKILLs all of them when the init dies. Nothing inside can
  SIGKILL or SIGSTOP its init, nor see the outer supervisor; the init dies with the outer
  supervisor (`PR_SET_PDEATHSIG`), so SIGKILLing the outer supervisor ends the whole tree.
- ``subreaper`` (fallback, where namespaces are not allowed): the supervisor marks itself a child
  subreaper (`PR_SET_CHILD_SUBREAPER`), so orphans are re-parented to it, and finds the tree by
  walking `/proc`. A server that kills or stops this supervisor can leave processes behind; the
  supervisor says on stderr that it uses this mode.

The environment variable `TREADLE_MCP_CONTAINMENT` (``pidns`` or ``subreaper``) is set for the
server, so a test or the server itself can tell which is in force.

The server inherits stdin, stdout and stderr directly (nothing is copied through the supervisor).
Stopping: on SIGTERM (or SIGHUP/SIGINT) it passes SIGTERM to every descendant, waits up to
`GRACE_SECONDS` (less than the two seconds the transport gives it before SIGKILL), then SIGKILLs
what is left and exits with the server's status. Exiting otherwise: once the server itself exits,
its leftovers are SIGKILLed at once.

This file runs as a script under `python -I -S` (the standard library only, nothing of Treadle's
imported) and must never exit while a descendant it could see is still running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time

#: Seconds the descendants have after SIGTERM before SIGKILL.
GRACE_SECONDS = 1.0
#: Name of the environment variable telling the server which containment is in force.
CONTAINMENT_VARIABLE = "TREADLE_MCP_CONTAINMENT"
#: Rounds of "kill what is left, reap, look again" before giving up (a fork bomb outpacing us).
_KILL_ROUNDS = 200
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_STOP = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}
_WATCHED = {signal.SIGCHLD, *_STOP}


def _descendants(root: int) -> list[int]:
    """Live descendants of `root`, read from /proc (a process gone meanwhile is skipped)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _signal_all(sig: int) -> int:
    """Send `sig` to every descendant; how many there were."""
    pids = _descendants(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return len(pids)


def _reap(server: int, status: list[int]) -> bool:
    """Collect every exited child; the server's exit code goes into `status`. Whether any child
    is left (as an init, no child left means nothing is left in the namespace)."""
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == server:
            status.append(os.waitstatus_to_exitcode(raw))


def _kill_all(server: int, status: list[int]) -> None:
    """SIGKILL descendants and reap them until none is left (orphans of the killed come to us)."""
    for _ in range(_KILL_ROUNDS):
        _reap(server, status)
        if _signal_all(signal.SIGKILL) == 0:
            break
        time.sleep(0.005)
    _reap(server, status)


def _stop(server: int, status: list[int]) -> None:
    _signal_all(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        _reap(server, status)
        if not _descendants(os.getpid()):
            break
        signal.sigtimedwait({signal.SIGCHLD}, min(left, 0.05))
    _kill_all(server, status)


def _stop_namespace(server: int, status: list[int]) -> None:
    """As the namespace's init: SIGTERM everyone in it, wait for the grace, SIGKILL the rest.
    `kill(-1, ...)` from init reaches every process of the namespace but init itself, and the
    kernel kills whatever a fork bomb adds meanwhile once init exits."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while (left := deadline - time.monotonic()) > 0 and _reap(server, status):
        signal.sigtimedwait({signal.SIGCHLD}, min(left, 0.05))
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    _reap(server, status)


def _spawn(argv: list[str], containment: str) -> int:
    """Start the server with the watched signals at their defaults; its pid (exit 127 if not)."""
    env = dict(os.environ)
    env[CONTAINMENT_VARIABLE] = containment
    try:
        server = os.posix_spawnp(argv[0], argv, env, setsigmask=(), setsigdef=tuple(_WATCHED))
    except OSError as error:
        print(f"could not run {argv[0]}: {error.strerror or error}", file=sys.stderr)
        os._exit(127)
    # The server has its own copies; the supervisor holding the pipes would keep them open.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    return server


def _exit_code(status: list[int]) -> int:
    code = status[0] if status else 1
    return 128 - code if code < 0 else code


def _enter_namespace(libc: ctypes.CDLL) -> str | None:
    """Unshare a PID namespace for our next child (with a user namespace mapping our own uid and
    gid when not root); None when done, else why not (nothing changed then)."""
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() != 0:
        if libc.unshare(_CLONE_NEWUSER) != 0:
            return f"user namespace: {os.strerror(ctypes.get_errno())}"
        # Right after the unshare the maps can always be written for our own ids; the server
        # then runs as the same user as without a namespace.
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1\n")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1\n")
    if libc.unshare(_CLONE_NEWPID) != 0:
        return f"pid namespace: {os.strerror(ctypes.get_errno())}"
    return None


def _run_init(argv: list[str], libc: ctypes.CDLL, parent_alive: int) -> int:
    """Pid 1 of the new namespace: start the server, reap orphans, stop everyone on SIGTERM."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The outer supervisor may have died before the line above: its end of the pipe is then
    # closed, which reads as readable (end of file).
    if select.select([parent_alive], [], [], 0)[0]:
        return 1
    os.close(parent_alive)
    server = _spawn(argv, "pidns")
    status: list[int] = []
    while not status:
        info = signal.sigwaitinfo(_WATCHED)
        if info.si_signo in _STOP:
            _stop_namespace(server, status)
            break
        _reap(server, status)
    # The server is gone: its leftovers die with us (the kernel kills the namespace as we exit).
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    return _exit_code(status)


def _run_outer(init: int) -> int:
    """Outside the namespace: pass stop signals to its init and exit with its status."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    while True:
        info = signal.sigwaitinfo(_WATCHED)
        if info.si_signo in _STOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGTERM)
            continue
        pid, raw = os.waitpid(init, os.WNOHANG)
        if pid == init:
            # The init's exit returns only once every process of its namespace is gone.
            return _exit_code([os.waitstatus_to_exitcode(raw)])


def _run_subreaper(argv: list[str], libc: ctypes.CDLL, why: str) -> int:
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reaper.py: prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
        return 126
    print(f"reaper.py: no PID namespace ({why}); supervising as a subreaper", file=sys.stderr)
    server = _spawn(argv, "subreaper")
    status: list[int] = []
    while not status:
        info = signal.sigwaitinfo(_WATCHED)
        if info.si_signo in _STOP:
            _stop(server, status)
            break
        _reap(server, status)
    _kill_all(server, status)
    return _exit_code(status)


def main(argv: list[str]) -> int:
    """Run `argv` as the server; the server's exit code (or 128 + signal number)."""
    if not argv:
        print("usage: reaper.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    # Blocked before any fork or spawn, so no SIGCHLD or SIGTERM is missed; the server starts
    # with them unblocked and at their defaults.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    why = "TREADLE_MCP_NO_PIDNS is set" if os.environ.get("TREADLE_MCP_NO_PIDNS") else None
    try:
        why = why or _enter_namespace(libc)
    except OSError as error:
        # A user namespace without a uid map would run the server as nobody: refuse instead.
        print(f"reaper.py: could not map the user namespace: {error}", file=sys.stderr)
        return 126
    if why is not None:
        return _run_subreaper(argv, libc, why)
    parent_alive, keep = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(keep)
        code = 1
        try:
            code = _run_init(argv, libc, parent_alive)
        finally:
            os._exit(code)
    os.close(parent_alive)
    return _run_outer(init)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
