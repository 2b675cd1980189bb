"""A stdio MCP server's supervisor: run as `python reaper.py COMMAND ARGS...`, it starts the
server and, when the server exits or the supervisor is told to stop, kills every process the
server left behind, including ones that left its process group with `setsid()`.

It marks itself a child subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`), so a descendant whose
parent exits is re-parented to it rather than to init: the whole tree stays below it, and it
finds the tree by walking `/proc` from its own pid. The server inherits stdin, stdout and stderr
directly (nothing is copied through the supervisor). Stopping: on SIGTERM (or SIGHUP/SIGINT) it
passes SIGTERM to every descendant, waits up to `GRACE_SECONDS` (less than the two seconds the
transport gives it before SIGKILL), then SIGKILLs what is left and exits with the server's
status. Exiting otherwise: once the server itself exits, its leftovers are SIGKILLed at once.

This file runs as a script under `python -I -S` (the standard library only, nothing of Treadle's
imported) and must never exit while a descendant it could see is still running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

#: Seconds the descendants have after SIGTERM before SIGKILL.
GRACE_SECONDS = 1.0
#: Rounds of "kill what is left, reap, look again" before giving up (a fork bomb outpacing us).
_KILL_ROUNDS = 200
_PR_SET_CHILD_SUBREAPER = 36
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


def _reap(server: int, status: list[int]) -> None:
    """Collect every exited child; the server's exit code goes into `status`."""
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
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


def main(argv: list[str]) -> int:
    """Run `argv` as the server; the server's exit code (or 128 + signal number)."""
    if not argv:
        print("usage: reaper.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reaper.py: prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
        return 126
    # Blocked before the spawn, so no SIGCHLD or SIGTERM is missed; the server starts with
    # them unblocked and at their defaults.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    try:
        server = os.posix_spawnp(
            argv[0], argv, dict(os.environ), setsigmask=(), setsigdef=tuple(_WATCHED)
        )
    except OSError as error:
        print(f"could not run {argv[0]}: {error.strerror or error}", file=sys.stderr)
        return 127
    # The server has its own copies; the supervisor holding the pipes would keep them open.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    status: list[int] = []
    while not status:
        info = signal.sigwaitinfo(_WATCHED)
        if info.si_signo in _STOP:
            _stop(server, status)
            break
        _reap(server, status)
    _kill_all(server, status)
    code = status[0] if status else 1
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
