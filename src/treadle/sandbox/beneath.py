"""Open files beneath a directory handle without ever following a symbolic link.

Every host-side operation on a box's files (the file tools, seeding, export) goes through here:
a path is split into plain names (`treadle.sandbox.paths.workspace_parts`) and resolved from an
open directory fd, never from a path string. On Linux 5.6+ one `openat2` call does it with
`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`: the kernel refuses (`ELOOP`,
`EXDEV`) a link or a climb anywhere on the way, atomically, so a box that swaps a directory for
a link meanwhile gains nothing. Without `openat2` the same walk is done one component at a time,
each opened `O_NOFOLLOW` relative to the directory fd before it. Both refuse every link, in-tree
ones included: a rule that follows "links that stay inside" needs a check and a use that a race
can separate. This module must never accept `..`, an absolute path or a link, and never block
on a FIFO (callers open with `O_NONBLOCK` where a FIFO could sit).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

__all__ = [
    "RESOLVE_BENEATH",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "has_openat2",
    "is_link_error",
    "kind_of",
    "make_dirs_beneath",
    "open_beneath",
    "open_directory",
    "opened",
]

#: `openat2` resolve flags (linux/openat2.h).
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "riscv64": 437, "ppc64le": 437, "s390x": 437}
_SYSCALL_NUMBER = _SYS_OPENAT2.get(os.uname().machine, -1)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


@functools.cache
def _syscall() -> tuple[Any, Any]:
    """libc's `syscall` and the `struct open_how` type (ctypes loads on the first use only)."""
    import ctypes

    class OpenHow(ctypes.Structure):
        _fields_ = [
            ("flags", ctypes.c_uint64),
            ("mode", ctypes.c_uint64),
            ("resolve", ctypes.c_uint64),
        ]

    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn, OpenHow


@functools.cache
def has_openat2() -> bool:
    """True when this kernel has `openat2` (Linux 5.6+) and the resolve flags work."""
    number = _SYS_OPENAT2.get(os.uname().machine)
    if number is None or not hasattr(os, "O_PATH"):
        return False
    try:
        fd = _openat2(os.open("/", _DIR_FLAGS), ".", _DIR_FLAGS, 0, close_dir=True)
    except OSError:
        return False
    os.close(fd)
    return True


def _openat2(dir_fd: int, name: str, flags: int, mode: int, *, close_dir: bool = False) -> int:
    import ctypes

    syscall, open_how = _syscall()
    # openat2 refuses a mode without O_CREAT/O_TMPFILE (O_TMPFILE's bits include O_DIRECTORY).
    creates = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE
    how = open_how(flags | os.O_CLOEXEC, mode if creates else 0, _RESOLVE)
    try:
        fd = int(
            syscall(
                ctypes.c_long(_SYSCALL_NUMBER),
                ctypes.c_int(dir_fd),
                ctypes.c_char_p(os.fsencode(name)),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
    finally:
        if close_dir:
            os.close(dir_fd)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), name)
    return fd


def _open_dir_step(dir_fd: int, name: str) -> int:
    """`name` below `dir_fd` opened as a directory; a link there is `ELOOP`, as for `openat2`."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except NotADirectoryError:
        # O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR: say which it was.
        if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise OSError(errno.ELOOP, "a symbolic link on the way", name) from None
        raise


def _walk_open(dir_fd: int, parts: Sequence[str], flags: int, mode: int) -> int:
    """The same resolution as `openat2` with `_RESOLVE`, one `O_NOFOLLOW` component at a time."""
    current = dir_fd
    try:
        for name in parts[:-1]:
            step = _open_dir_step(current, name)
            if current != dir_fd:
                os.close(current)
            current = step
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
    finally:
        if current != dir_fd:
            os.close(current)


def open_beneath(
    dir_fd: int,
    parts: Sequence[str],
    flags: int,
    mode: int = 0o644,
    *,
    use_openat2: bool | None = None,
) -> int:
    """An fd for `parts` (plain names, no `..`) below `dir_fd`, no link followed on the way.

    Raises `OSError`: `ELOOP` for a link anywhere on the path (the last name included), `EXDEV`
    for a path that would leave `dir_fd`. `use_openat2` forces one resolver (tests and the
    benchmark); by default `openat2` where the kernel has it.
    """
    if not parts:  # the directory itself (a write is EISDIR)
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    for name in parts:
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise OSError(errno.EXDEV, "not a plain name below the directory", name)
    fast = has_openat2() if use_openat2 is None else use_openat2
    if fast:
        return _openat2(dir_fd, "/".join(parts), flags, mode)
    return _walk_open(dir_fd, parts, flags, mode)


def open_directory(dir_fd: int, parts: Sequence[str]) -> int:
    """An fd of the directory `parts` below `dir_fd` (`ELOOP` if any of it is a link)."""
    return open_beneath(dir_fd, parts, os.O_RDONLY | os.O_DIRECTORY)


def make_dirs_beneath(dir_fd: int, parts: Sequence[str], mode: int = 0o755) -> int:
    """Create the directories `parts` below `dir_fd` as needed and return an fd of the last.

    Each directory is made with `mkdirat` relative to the fd of its parent and then opened with
    `O_NOFOLLOW`, so a link planted at any step is refused (`ELOOP`), never written through.
    """
    current = os.dup(dir_fd)
    try:
        for name in parts:
            if not name or name in (".", "..") or "/" in name:
                raise OSError(errno.EXDEV, "not a plain name below the directory", name)
            with suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=current)
            step = _open_dir_step(current, name)
            os.close(current)
            current = step
    except BaseException:
        os.close(current)
        raise
    return current


@contextmanager
def opened(fd: int) -> Iterator[int]:
    """Close `fd` on leaving the block."""
    try:
        yield fd
    finally:
        os.close(fd)


def is_link_error(err: OSError) -> bool:
    """True when `err` is a resolver refusing a link or a way out (`ELOOP`, `EXDEV`)."""
    return err.errno in (errno.ELOOP, errno.EXDEV)


def kind_of(mode: int) -> str:
    """A file type in words, for error messages."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file (FIFO, socket or device)"
