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

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from treadle.errors import SandboxError

__all__ = ["give_tree_to", "remove_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OWNER_RWX = 0o700


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
                up = os.open("..", _DIR_FLAGS, dir_fd=current)
                if _ident(os.fstat(up)) != levels[-1].ident:
                    os.close(up)
                    raise SandboxError(
                        f"a directory in {root} moved while Treadle walked it; stop the box's "
                        "commands and try again."
                    )
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


def remove_tree(root: Path) -> None:
    """Delete `root` and everything below it, whatever depth and modes a box left.

    Raises `SandboxError` naming what could not be removed (never a silent leftover).
    """
    errors: list[str] = []
    try:
        for event in _walk(root, fix_modes=True, errors=errors):
            try:
                if event.kind == "entry":
                    os.unlink(event.name, dir_fd=event.fd)
                elif event.kind == "leave":
                    os.rmdir(event.name, dir_fd=event.fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(f"{event.name!r}: {e.strerror}")
        os.rmdir(root)
    except FileNotFoundError:
        if not errors and not os.path.lexists(root):
            return
        errors.append(f"{root.name!r}: vanished during removal")
    except OSError as e:
        errors.append(f"{root}: {e.strerror}")
    if errors or os.path.lexists(root):
        shown = "; ".join(errors[:3]) or "entries left"
        raise SandboxError(
            f"could not delete the workspace {root} ({shown}); delete it by hand (as root if "
            "a command made root-owned files)."
        )


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
