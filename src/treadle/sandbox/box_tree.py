"""Whole-tree work on a box's workspace from the host: removal on close, hand-over (chown).

A box controls its tree: any depth (thousands of levels, paths past `PATH_MAX`), any modes
(`chmod 000`), links anywhere, and while a command runs it can rename entries under the walk.
So the walk here is iterative (no recursion limit), holds one directory fd at a time (no fd
limit), resolves every name relative to that fd, opens directories `O_NOFOLLOW | O_DIRECTORY`
(a link is never entered), and climbs back with `..` only after checking that the directory it
reaches is the one it left (device and inode), so a directory moved elsewhere meanwhile stops
the walk instead of steering it. This module must never follow a link and never act on an
entry outside the tree it was given.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from treadle.errors import SandboxError

__all__ = ["RemovalStopped", "give_tree_to", "remove_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OWNER_RWX = 0o700
#: Threads unlinking one directory's files at once (see `_Unlinker`), from this many files on.
_UNLINK_THREADS = 16
_PARALLEL_FROM = 64
_CHUNK = 128


@dataclass
class _Level:
    name: str  # this directory's name in its parent ("" for the root)
    ident: tuple[int, int]  # (st_dev, st_ino): checked when the walk climbs back to it
    pending: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Event:
    kind: str  # "enter" (fd: the directory), "entry" (fd: its parent), "leave" (fd: its parent)
    fd: int
    name: str
    info: os.stat_result | None = None


def _ident(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _climb(current: int, ident: tuple[int, int], root: Path, doing: str) -> int:
    """An fd of `current`'s parent, which must be the directory the walk came down from
    (`ident`): one moved meanwhile stops the walk (`doing`: what Treadle did to `root`)."""
    up = os.open("..", _DIR_FLAGS, dir_fd=current)
    if _ident(os.fstat(up)) != ident:
        os.close(up)
        raise SandboxError(
            f"a directory in {root} moved while Treadle {doing} it; stop the box's "
            "commands and try again."
        )
    return up


def _make_accessible(parent_fd: int, name: str) -> None:
    """Give the directory `name` u+rwx without following a link (Linux has no lchmod).

    An `O_PATH | O_NOFOLLOW` fd names the directory itself (it needs no rights on it), and
    chmod through `/proc/self/fd` acts on exactly that object.
    """
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode) and mode & _OWNER_RWX != _OWNER_RWX:
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(mode) | _OWNER_RWX)
    finally:
        os.close(fd)


def _open_dir(parent_fd: int, name: str, *, fix_modes: bool) -> int:
    if fix_modes:
        _make_accessible(parent_fd, name)
    return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def _walk(root: Path, *, fix_modes: bool, errors: list[str]) -> Iterator[_Event]:
    """Events of a depth-first walk of `root`, children before their directory's "leave".

    Entries that vanish or turn into something else during the walk are skipped; entries the
    walk cannot open go to `errors`. The fd in an event is valid only until the next event.
    """
    parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        current = _open_dir(parent, root.name, fix_modes=fix_modes)
    finally:
        os.close(parent)
    try:
        info = os.fstat(current)
        levels = [_Level("", _ident(info), sorted(os.listdir(current), reverse=True))]
        yield _Event("enter", current, "", info)
        while levels:
            level = levels[-1]
            if not level.pending:
                levels.pop()
                if not levels:
                    return
                up = _climb(current, levels[-1].ident, root, "walked")
                os.close(current)
                current = up
                yield _Event("leave", current, level.name)
                continue
            name = level.pending.pop()
            try:
                info = os.stat(name, dir_fd=current, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(info.st_mode):
                yield _Event("entry", current, name, info)
                continue
            try:
                child = _open_dir(current, name, fix_modes=fix_modes)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    errors.append(f"{name!r}: {e.strerror}")
                continue  # gone, or swapped for a link or a file: never entered
            try:
                names = sorted(os.listdir(child), reverse=True)
                child_info = os.fstat(child)
            except OSError as e:
                os.close(child)
                errors.append(f"{name!r}: {e.strerror}")
                continue
            os.close(current)
            current = child
            levels.append(_Level(name, _ident(child_info), names))
            yield _Event("enter", current, name, child_info)
    finally:
        os.close(current)


class RemovalStopped(SandboxError):
    """`remove_tree` was asked to stop (process exit); the tree is partly removed."""


class _Unlinker:
    """Unlinks a directory's files by name relative to its fd, many at once when there are many.

    On a file system mounted with `discard` (this machine's ext4) each unlink of a file with
    data waits for the device's TRIM: about 1.7 ms, 50 times what an empty file costs. Those
    waits overlap when several threads unlink (16 threads: 8 times faster here), and `unlinkat`
    releases the GIL. Every batch finishes before the walk moves on, so the fd stays the one
    checked and every name stays relative to it.
    """

    def __init__(self, stop: threading.Event | None, errors: list[str]) -> None:
        self.stop = stop
        self.errors = errors
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the unlinking threads."""
        if self._pool is not None:
            self._pool.shutdown()

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise RemovalStopped("stopped")

    def clear(self, fd: int) -> list[str]:
        """Unlink every non-directory in the directory `fd`; return its subdirectories' names.

        Types come from the listing itself (`d_type`): no entry is stat'ed. An entry that turned
        into a directory since it was listed is returned with the others (`unlinkat` never
        follows a link and refuses a directory).
        """
        subdirs: list[str] = []
        files: list[str] = []
        with os.scandir(fd) as listing:
            for entry in listing:
                (subdirs if entry.is_dir(follow_symlinks=False) else files).append(entry.name)
        self._check_stop()
        if len(files) < _PARALLEL_FROM:
            subdirs += self._unlink(fd, files)
            return subdirs
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_UNLINK_THREADS, thread_name_prefix="treadle-rm")
        chunks = [files[i : i + _CHUNK] for i in range(0, len(files), _CHUNK)]
        try:
            done = list(self._pool.map(self._unlink, [fd] * len(chunks), chunks))
        except RuntimeError:  # interpreter exit began: no new pool work, so one at a time
            done = [self._unlink(fd, files)]
        for more in done:
            subdirs += more
        self._check_stop()
        return subdirs

    def _unlink(self, fd: int, names: list[str]) -> list[str]:
        """Unlink `names` in `fd`; return those that are directories after all."""
        dirs = []
        for name in names:
            if self.stop is not None and self.stop.is_set():
                break  # `clear` raises once the batch is done
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                dirs.append(name)
            except OSError as e:
                if e.errno == errno.EPERM and _is_dir(fd, name):  # EPERM: unlink of a directory
                    dirs.append(name)
                else:
                    self.errors.append(f"{name!r}: {e.strerror}")
        return dirs


def _is_dir(fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _enter(parent_fd: int, name: str, fix_modes: bool) -> int:
    """The directory `name` opened (never through a link), made writable by its owner."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        if not fix_modes:
            raise
        fd = _open_dir(parent_fd, name, fix_modes=True)  # `chmod 000`: fixed, then opened
    if fix_modes:
        mode = os.fstat(fd).st_mode
        if mode & _OWNER_RWX != _OWNER_RWX:  # unlinking its entries needs u+wx
            os.fchmod(fd, stat.S_IMODE(mode) | _OWNER_RWX)
    return fd


def remove_tree(root: Path, stop: threading.Event | None = None) -> None:
    """Delete `root` and everything below it, whatever depth and modes a box left.

    One directory fd is held at a time; each directory's files go with one `unlinkat` each
    (types from the listing, no `stat`), and a directory is left through `..` only after
    checking it is the one entered (device and inode). `stop` set makes it raise
    `RemovalStopped` between two entries (the rest can be removed by calling it again).
    Raises `SandboxError` naming what could not be removed (never a silent leftover).
    """
    errors: list[str] = []
    unlinker = _Unlinker(stop, errors)
    try:
        _remove_below(root, unlinker, errors)
        os.rmdir(root)
    except RemovalStopped:
        raise RemovalStopped(f"the removal of {root} was stopped; it is partly removed") from None
    except FileNotFoundError:
        if not errors and not os.path.lexists(root):
            return
        errors.append(f"{root.name!r}: vanished during removal")
    except OSError as e:
        errors.append(f"{root}: {e.strerror}")
    finally:
        unlinker.close()
    if errors or os.path.lexists(root):
        shown = "; ".join(errors[:3]) or "entries left"
        raise SandboxError(
            f"could not delete the workspace {root} ({shown}); delete it by hand (as root if "
            "a command made root-owned files)."
        )


def _remove_below(root: Path, unlinker: _Unlinker, errors: list[str]) -> None:
    """Everything below `root` (left empty); what could not go is added to `errors`."""
    fix_modes = os.geteuid() != 0  # root's CAP_DAC_OVERRIDE needs no mode fixed
    with _opened_parent(root) as parent:
        current = _enter(parent, root.name, fix_modes)
    try:
        levels = [_Level("", _ident(os.fstat(current)), unlinker.clear(current))]
        while levels:
            level = levels[-1]
            if level.pending:
                name = level.pending.pop()
                try:
                    child = _enter(current, name, fix_modes)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno in (errno.ENOTDIR, errno.ELOOP):  # swapped for a file or link
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name, dir_fd=current)
                    else:
                        errors.append(f"{name!r}: {e.strerror}")
                    continue
                try:
                    names = unlinker.clear(child)
                    ident = _ident(os.fstat(child))
                except BaseException:
                    os.close(child)
                    raise
                os.close(current)
                current = child
                levels.append(_Level(name, ident, names))
                continue
            levels.pop()
            if not levels:
                break
            up = _climb(current, levels[-1].ident, root, "removed")
            os.close(current)
            current = up
            try:
                os.rmdir(level.name, dir_fd=current)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(f"{level.name!r}: {e.strerror}")
    finally:
        os.close(current)


@contextlib.contextmanager
def _opened_parent(root: Path) -> Iterator[int]:
    fd = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def give_tree_to(root: Path, uid: int) -> None:
    """Make `uid` own every entry below `root` (and `root`), never through a link.

    Directories are changed through the fd the walk opened (`O_NOFOLLOW`); other entries by
    name relative to their parent's fd with `AT_SYMLINK_NOFOLLOW`. A regular file with other
    hard links may be a host file linked in by hand: it is left alone.
    """
    errors: list[str] = []
    for event in _walk(root, fix_modes=False, errors=errors):
        try:
            if event.kind == "enter":
                os.fchown(event.fd, uid, uid)
            elif event.kind == "entry" and event.info is not None:
                if stat.S_ISREG(event.info.st_mode) and event.info.st_nlink > 1:
                    continue
                os.chown(event.name, uid, uid, dir_fd=event.fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # the box removed it meanwhile
    if errors:
        raise SandboxError(
            f"could not hand every file in {root} to the box ({'; '.join(errors[:3])}); "
            "seed again when no command runs."
        )
