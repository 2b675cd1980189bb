"""All-or-nothing seeding: unpack into a staging directory, check, then move into place.

`treadle.sandbox.seeding` writes a seed into a fresh 0700 directory `.treadle-seed-<random>`
made *beside* the workspace (in its parent, which no box sees or can name), when that is on the
same mount (so every move is a `rename`); only otherwise inside the workspace root. Only when
the whole source was accepted is the staged tree checked against what the workspace holds (a
link or a file on the way, a directory where the seed has a file, a directory a command made
unwritable: refused before anything moves) and moved into place:
a new name moves with its whole subtree in one `rename`, a file replaces the entry at
its name (a link there is replaced, never followed), a directory that exists on both sides is
merged. A refused archive, or a conflict, removes the staging directory and leaves the
workspace as it was. Every name is resolved from a directory fd without following links
(`treadle.sandbox.beneath`). This module must never write outside the workspace and its own
staging directory.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from treadle.errors import PathViolation, SandboxError
from treadle.sandbox.beneath import is_link_error, make_dirs_beneath, open_beneath, opened
from treadle.sandbox.box_tree import remove_tree

__all__ = ["staged"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_Parts = tuple[str, ...]


@contextmanager
def staged(root: Path, root_fd: int, place: _Parts, into: str) -> Iterator[int]:
    """An fd of a fresh staging directory: fill it in the block; on a normal exit its tree is
    moved to `place` below the workspace, on an error nothing is. The staging directory goes
    either way."""
    _check_place(root_fd, place, into)
    stage = _make_stage(root, root_fd)
    try:
        with opened(os.open(stage, _DIR)) as stage_fd:
            yield stage_fd
            moves = _plan(stage_fd, root_fd, place)
            for parts in moves:
                _move(stage_fd, root_fd, place, parts)
    finally:
        remove_tree(stage)


def _mount_id(fd: int) -> str | None:
    """The mount a file descriptor is on (Linux `/proc/self/fdinfo`), or None if unknown."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("mnt_id:"):
                    return line.split()[1]
    except OSError:
        pass
    return None


def _make_stage(root: Path, root_fd: int) -> Path:
    """A fresh 0700 staging directory: beside the workspace when a `rename` from there into it
    works (same mount), so a command in the box can neither see nor rename it while the seed is
    unpacked; else inside the workspace root."""
    try:
        with opened(os.open(root.parent, _DIR)) as parent_fd:
            same = os.fstat(parent_fd).st_dev == os.fstat(root_fd).st_dev and (
                _mount_id(parent_fd) == _mount_id(root_fd)
            )
        if same:
            return Path(tempfile.mkdtemp(prefix=".treadle-seed-", dir=root.parent))
    except OSError:
        pass  # the parent is not ours to write: stage inside the workspace
    name = f".treadle-seed-{secrets.token_hex(6)}"
    try:
        os.mkdir(name, 0o700, dir_fd=root_fd)
    except OSError as e:
        raise _unwritable(root, e) from None
    return root / name


def _unwritable(root: Path, e: OSError) -> SandboxError:
    return SandboxError(
        f"cannot seed the workspace {root} ({e.strerror}): a command changed its permissions "
        "(e.g. `chmod 000 .`); give the owner write and search rights back (`chmod u+rwx` it, "
        "or run `chmod 700 .` in the box) and seed again. Nothing was seeded."
    )


def _check_writable(fd: int, parts: _Parts) -> None:
    """Refuse (before anything moves) a destination directory this process cannot write
    into: a command can leave one with `chmod 555` in an earlier pass."""
    if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd, effective_ids=True):
        shown = "/".join(parts) or "."
        raise SandboxError(
            f"cannot seed into {shown!r}: a command left it without write permission "
            f"(mode {stat.S_IMODE(os.fstat(fd).st_mode):o}); give it back (`chmod u+w` in the "
            "box) and seed again. Nothing was seeded."
        )


def _check_place(root_fd: int, place: _Parts, into: str) -> None:
    """`into` is a directory or does not exist yet (a link or a file on its way is refused)."""
    try:
        os.close(open_beneath(root_fd, place, _DIR))
    except OSError as e:
        if is_link_error(e) or e.errno == errno.ENOTDIR:
            raise PathViolation(
                f"cannot seed into {into!r}: it is or passes through a symbolic link or a file."
            ) from None
        if e.errno != errno.ENOENT:
            raise SandboxError(f"cannot seed into {into!r} ({e.strerror}).") from None


def _kind(fd: int, name: str) -> int | None:
    """The file type of `name` in the directory `fd` (never following a link); None if none."""
    try:
        return stat.S_IFMT(os.lstat(name, dir_fd=fd).st_mode)
    except FileNotFoundError:
        return None


def _refused(parts: _Parts, e: OSError) -> SandboxError:
    shown = "/".join(parts)
    if is_link_error(e) or e.errno == errno.ENOTDIR:
        return PathViolation(
            f"cannot seed {shown!r}: the workspace has a symbolic link or a file on its way "
            "(left by a command?); clear it first. Nothing was seeded."
        )
    return SandboxError(f"cannot seed {shown!r} ({e.strerror}). Nothing was seeded.")


def _plan(stage_fd: int, root_fd: int, place: _Parts) -> list[_Parts]:
    """The staged entries to move (each with its subtree), after checking that every one fits
    what the workspace holds; raises before anything moved."""
    moves: list[_Parts] = []
    pending: list[_Parts] = [()]
    while pending:
        here = pending.pop()
        try:
            dest_fd = open_beneath(root_fd, (*place, *here), _DIR)
        except FileNotFoundError:
            _check_writable_ancestor(root_fd, place)
            moves.append(here)  # nothing there yet: the whole staged directory moves
            continue
        except OSError as e:
            raise _refused((*place, *here), e) from None
        with opened(dest_fd), opened(open_beneath(stage_fd, here, _DIR)) as src_fd:
            names = sorted(os.listdir(src_fd))
            if names:  # something moves into (or through, for merged directories) this one
                _check_writable(dest_fd, (*place, *here))
            for name in names:
                mine, theirs = _kind(src_fd, name), _kind(dest_fd, name)
                parts = (*here, name)
                if theirs is None:
                    moves.append(parts)
                elif mine == stat.S_IFDIR and theirs == stat.S_IFDIR:
                    pending.append(parts)
                elif mine == stat.S_IFDIR and theirs == stat.S_IFLNK:
                    raise _refused((*place, *parts), OSError(errno.ELOOP, "a link"))
                elif mine == stat.S_IFDIR or theirs == stat.S_IFDIR:
                    what = "a directory" if theirs == stat.S_IFDIR else "a file or a link"
                    raise SandboxError(
                        f"cannot seed {'/'.join((*place, *parts))!r}: the workspace has {what} "
                        "there. Nothing was seeded."
                    )
                else:
                    moves.append(parts)  # a file or a link replaces the file or link there
    return moves


def _check_writable_ancestor(root_fd: int, place: _Parts) -> None:
    """The deepest existing directory of `place` (where its missing ones will be made)."""
    for depth in range(len(place), -1, -1):
        try:
            fd = open_beneath(root_fd, place[:depth], _DIR)
        except OSError:
            continue
        with opened(fd):
            _check_writable(fd, place[:depth])
        return


def _move(stage_fd: int, root_fd: int, place: _Parts, parts: _Parts) -> None:
    """Rename the staged `parts` to its place (its destination parent made as needed)."""
    dest = (*place, *parts)
    try:
        if not parts:  # `into` did not exist: the staging directory's entries move into it
            os.close(make_dirs_beneath(root_fd, place))
            _each(stage_fd, lambda name: _move(stage_fd, root_fd, place, (name,)))
            return
        with (
            opened(open_beneath(stage_fd, parts[:-1], _DIR)) as src_parent,
            opened(make_dirs_beneath(root_fd, dest[:-1])) as dest_parent,
        ):
            os.rename(parts[-1], dest[-1], src_dir_fd=src_parent, dst_dir_fd=dest_parent)
    except OSError as e:
        # All was checked (types, links, write permission): only a command changing the
        # workspace while it is seeded, or a full disk, gets here.
        raise SandboxError(
            f"cannot move the seeded {'/'.join(dest)!r} into place ({e.strerror}); the seed is "
            "partly in place: seed again when no command runs."
        ) from None


def _each(fd: int, action: Callable[[str], None]) -> None:
    for name in sorted(os.listdir(fd)):
        action(name)
