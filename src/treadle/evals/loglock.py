"""The one-writer lock of an evaluation log: an `flock` on the log file itself (so every path to
it meets the same lock) and a note naming its holder beside the log's real path, opened without
following a planted symlink. This module must never write through a symlink it did not make.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import stat
import time
from pathlib import Path

from pydantic_core import from_json, to_json

from treadle.errors import EvalLogBusyError, PersistenceError

__all__ = ["lock_log", "lock_path", "unlock_log"]


def lock_path(log: str | os.PathLike[str]) -> Path:
    """The holder note beside a log's real path (`run.jsonl.lock`), naming the run writing it.

    The lock itself is an `flock` on the log file, so a symlink or hard link to the log meets it
    too; this file only says who holds it."""
    path = Path(os.path.realpath(log))
    return path.with_name(path.name + ".lock")


def lock_log(log: Path) -> int:
    """Lock the log file itself and note the holder beside it; `EvalLogBusyError` naming the
    holder. Returns the locked descriptor of the log."""
    try:
        fd = os.open(log, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise PersistenceError(f"cannot open the log {log}: {error}; pick another --log.") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PersistenceError(f"{log} is not a regular file; pick another --log.")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise EvalLogBusyError(
            f"{log} is being written by another run ({_named_holder(log)}); wait for it to "
            "end, or give this run another log."
        ) from None
    except BaseException:
        os.close(fd)
        raise
    note = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    try:
        # O_NOFOLLOW: a symlink planted at the note's name is refused, never written through
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        note_fd = os.open(lock_path(log), flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(note_fd).st_mode):
                raise OSError(f"{lock_path(log)} is not a regular file")
            os.ftruncate(note_fd, 0)
            os.pwrite(note_fd, to_json(note) + b"\n", 0)
        finally:
            os.close(note_fd)
    except OSError as error:
        os.close(fd)
        raise PersistenceError(
            f"cannot write the holder note {lock_path(log)} ({error}); remove what is at that "
            "path (a symlink is never followed) and run again."
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


# How long a refused run waits for the holder to write its note (it takes the lock first, then
# writes the note, so a run refused in between would otherwise name nobody).
_NOTE_WAIT = 2.0


def _named_holder(log: Path) -> str:
    """The holder note's text, waiting briefly (this runs on a worker thread) for a holder that
    has just taken the lock to write it. The note sits beside the path its holder used, so a run
    reaching the log through another path (a hard link) may find no note, or another run's: the
    lock's owner by the file's identity (`/proc/locks` on Linux) decides which is true."""
    owner = _flock_owner(log)
    deadline = time.monotonic() + _NOTE_WAIT
    while True:
        said, pid = _holder(lock_path(log))
        if owner is not None and pid != owner:
            # No note here, or one left by another run: say who holds the file's lock.
            return f"pid {owner} on {socket.gethostname()} (its holder note is beside another path)"
        if pid is not None or time.monotonic() > deadline:
            return said
        time.sleep(0.02)


def _flock_owner(log: Path) -> int | None:
    """The pid holding an exclusive `flock` on the file `log` names, found by its device and
    inode in `/proc/locks` (None where Linux does not say, or when nobody holds it)."""
    try:
        st = os.stat(log)
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            table = locks.read()
    except OSError:
        return None
    identity = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12801 fe:00:2146371 0 EOF" (blocked waiters start "->")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == identity:
            with contextlib.suppress(ValueError):
                return int(fields[4])
    return None


def _holder(note: Path) -> tuple[str, int | None]:
    """What the holder note says, and the pid it names (None: no readable note)."""
    try:
        fd = os.open(note, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            data = from_json(os.pread(fd, 4096, 0))
        finally:
            os.close(fd)
        started = datetime.datetime.fromtimestamp(float(data["started"]), datetime.UTC)
        pid = int(data["pid"])
        return f"pid {pid} on {data['host']}, started {started:%Y-%m-%d %H:%M:%S} UTC", pid
    except (OSError, ValueError, TypeError, KeyError, OverflowError):
        return "its holder has not written its name yet", None


def unlock_log(fd: int) -> None:
    """Release the lock `lock_log` took and close its descriptor."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
