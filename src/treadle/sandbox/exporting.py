"""Take a workspace's results out to the host: for evaluation harnesses.

`export_workspace` copies the workspace (or a part) to a host directory or a `.tar.gz`, on the
sandbox I/O threads. The box's side is read only through directory fds (`treadle.sandbox.beneath`):
each entry is opened without following a link and handled by what the opened fd is, so a command
that swaps names while the export runs can only change which of its own files are copied. On the
host side no entry that is a link is written through: the export refuses it. Links in the
workspace are dropped from a directory export and kept in a tarball only when they cannot leave
the exported tree (relative, no `..`). Sparse files keep their holes, and an export stops with
`SandboxError` past `max_bytes`. This module must never follow a link in either tree, open a FIFO
for longer than a non-blocking `open`, or write outside `dest`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tarfile
from pathlib import Path

from treadle.errors import PathViolation, SandboxError
from treadle.sandbox.beneath import is_link_error, open_beneath, opened
from treadle.sandbox.local import _IO
from treadle.sandbox.opening import Sandbox
from treadle.sandbox.paths import workspace_parts

__all__ = ["MAX_EXPORT_BYTES", "MAX_EXPORT_DEPTH", "MAX_EXPORT_ENTRIES", "export_workspace"]

#: Default cap on what one export copies: data bytes for a directory (holes are free), file
#: sizes for a tarball (a tarball stores holes as zeros).
MAX_EXPORT_BYTES = 2 * 1024**3
#: Deepest directory nesting an export follows (a box can nest directories cheaply; each level
#: holds two fds and a stack frame here).
MAX_EXPORT_DEPTH = 256
#: Default cap on the directory entries one export visits (files, directories, links and the
#: rest): empty files cost no bytes, but each is an inode and a name on the host.
MAX_EXPORT_ENTRIES = 100_000
_CHUNK = 1024 * 1024
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


async def export_workspace(
    sandbox: Sandbox,
    dest: str | os.PathLike[str],
    *,
    path: str = ".",
    max_bytes: int = MAX_EXPORT_BYTES,
    max_entries: int = MAX_EXPORT_ENTRIES,
) -> Path:
    """Copy the workspace directory (or file) `path` to host directory `dest` (merged into it if
    it exists), or to a gzipped tarball when `dest` ends in `.tar.gz`/`.tgz`; return `dest`.

    Regular files and directories are copied (sparse files stay sparse); FIFOs, sockets and
    devices are skipped; links are dropped (kept in a tarball when relative without `..`).
    `PathViolation` when an entry of `dest` is a link; `SandboxError` past `max_bytes`, or past
    `max_entries` directory entries.
    """
    out = Path(dest)
    await _IO.run(_export, sandbox.workspace, path, out, _Budget(max_bytes, max_entries))
    return out


class _Budget:
    def __init__(self, limit: int, max_entries: int) -> None:
        self.limit = limit
        self.used = 0
        self.max_entries = max_entries
        self.entries = 0

    def names(self, dir_fd: int) -> list[str]:
        """The entries of `dir_fd`, sorted, each counted (the listing stops at the cap)."""
        found = []
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                self.entries += 1
                if self.entries > self.max_entries:
                    raise SandboxError(
                        f"the export has more than {self.max_entries} entries (files, "
                        "directories and links); export a smaller part with path=..., or raise "
                        "max_entries."
                    )
                found.append(entry.name)
        return sorted(found)

    def descend(self, depth: int) -> None:
        if depth > MAX_EXPORT_DEPTH:
            raise SandboxError(
                f"the export is nested deeper than {MAX_EXPORT_DEPTH} directories; export a "
                "part of it with path=..."
            )

    def charge(self, n: int) -> None:
        self.used += n
        if self.used > self.limit:
            raise SandboxError(
                f"the export is larger than its cap ({self.limit} bytes); export a smaller "
                "part with path=..., or raise max_bytes."
            )


def _export(root: Path, path: str, dest: Path, budget: _Budget) -> None:
    parts = workspace_parts(root, path)
    with opened(os.open(root, _DIR & ~os.O_NOFOLLOW)) as root_fd:
        try:
            src = open_beneath(root_fd, parts, _READ)
        except OSError as e:
            if is_link_error(e):
                raise PathViolation(
                    f"cannot export {path!r}: it is or passes through a symbolic link."
                ) from None
            raise SandboxError(f"cannot export {path!r} ({e.strerror}).") from None
    with opened(src):
        info = os.fstat(src)
        if dest.name.endswith((".tar.gz", ".tgz")):
            _to_tarball(src, info, dest, parts, budget)
        elif stat.S_ISDIR(info.st_mode):
            with opened(_host_directory(dest)) as dst:
                _copy_tree(src, dst, dest, budget)
        elif stat.S_ISREG(info.st_mode):
            dest.parent.mkdir(parents=True, exist_ok=True)
            with opened(os.open(dest.parent, _DIR & ~os.O_NOFOLLOW)) as parent:
                _copy_file(src, info, parent, dest.name, dest, budget)
        else:
            raise SandboxError(f"cannot export {path!r}: it is not a file or a directory.")


def _host_directory(dest: Path) -> int:
    """An fd of directory `dest`, made if missing; a link there is refused."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return os.open(dest, _DIR)
    except OSError as e:
        if is_link_error(e) or (e.errno == errno.ENOTDIR and dest.is_symlink()):
            raise _link_in_dest(dest) from None
        raise SandboxError(f"cannot export into {dest} ({e.strerror}).") from None


def _link_in_dest(where: Path) -> PathViolation:
    return PathViolation(
        f"the export destination entry {where} is a symbolic link; exports never write through "
        "links: remove it or export to a fresh directory."
    )


def _open_entry(dir_fd: int, name: str) -> tuple[int, os.stat_result] | None:
    """`name` below `dir_fd` opened without following a link, with what it is; None for a link,
    a special file or a name that vanished."""
    try:
        before = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    if not (stat.S_ISREG(before.st_mode) or stat.S_ISDIR(before.st_mode)):
        return None  # links dropped; FIFOs, sockets and devices never opened
    try:
        fd = os.open(name, _READ | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None  # swapped for a link (ELOOP), a socket (ENXIO) or gone: the box's race
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
        return fd, info
    os.close(fd)
    return None


def _copy_tree(src: int, dst: int, where: Path, budget: _Budget, depth: int = 0) -> None:
    budget.descend(depth)
    for name in budget.names(src):
        found = _open_entry(src, name)
        if found is None:
            continue
        fd, info = found
        with opened(fd):
            if stat.S_ISDIR(info.st_mode):
                with opened(_host_subdirectory(dst, name, where / name)) as child:
                    _copy_tree(fd, child, where / name, budget, depth + 1)
            else:
                _copy_file(fd, info, dst, name, where / name, budget)


def _host_subdirectory(dst: int, name: str, where: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=dst)
    try:
        return os.open(name, _DIR, dir_fd=dst)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            if stat.S_ISLNK(os.lstat(name, dir_fd=dst).st_mode):
                raise _link_in_dest(where) from None
            raise SandboxError(f"cannot export the directory {where}: a file is there.") from None
        raise


def _copy_file(
    src: int, info: os.stat_result, dst: int, name: str, where: Path, budget: _Budget
) -> None:
    try:
        there = os.lstat(name, dir_fd=dst)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISLNK(there.st_mode):
            raise _link_in_dest(where)
        if stat.S_ISDIR(there.st_mode):
            raise SandboxError(f"cannot export the file {where}: a directory is there.")
        os.unlink(name, dir_fd=dst)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    out = os.open(name, flags, stat.S_IMODE(info.st_mode) & 0o755 | 0o600, dir_fd=dst)
    with opened(out):
        _copy_data(src, out, info.st_size, budget)


def _copy_data(src: int, out: int, size: int, budget: _Budget) -> None:
    """Copy the data regions of `src` (first `size` bytes) into `out`, leaving holes as holes."""
    os.set_blocking(src, True)
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here on
                break
            raise
        end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        if end <= start:  # the box truncated it meanwhile
            break
        while start < end:
            n = min(_CHUNK, end - start)
            budget.charge(n)
            chunk = os.pread(src, n, start)
            if not chunk:  # the box truncated it meanwhile
                break
            os.pwrite(out, chunk, start)
            start += len(chunk)
        pos = end
    os.ftruncate(out, size)


class _Exactly(io.RawIOBase):
    """`size` bytes of fd `fd` from offset 0, zero-padded if the box shrinks it meanwhile."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.left, self.pos = fd, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        if n == 0:
            return 0
        chunk = os.pread(self.fd, n, self.pos) or b""
        chunk += bytes(n - len(chunk))
        buffer[:n] = chunk
        self.pos += n
        self.left -= n
        return n


def _to_tarball(
    src: int, info: os.stat_result, dest: Path, parts: tuple[str, ...], budget: _Budget
) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink():
        raise _link_in_dest(dest)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    raw = os.fdopen(os.open(dest, flags, 0o644), "wb")
    with raw, tarfile.open(fileobj=raw, mode="w:gz") as archive:
        if stat.S_ISDIR(info.st_mode):
            _add_tree(archive, src, info, ".", budget)
        else:
            _add_file(archive, src, info, "./" + parts[-1], budget)


def _add_tree(
    archive: tarfile.TarFile,
    src: int,
    info: os.stat_result,
    name: str,
    budget: _Budget,
    depth: int = 0,
) -> None:
    budget.descend(depth)
    entry = tarfile.TarInfo(name)
    entry.type, entry.mode, entry.mtime = tarfile.DIRTYPE, stat.S_IMODE(info.st_mode), info.st_mtime
    archive.addfile(entry)
    for child in budget.names(src):
        member = f"{name}/{child}"
        try:
            mode = os.lstat(child, dir_fd=src).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            target = os.readlink(child, dir_fd=src)
            if _stays_in_tree(target):
                link = tarfile.TarInfo(member)
                link.type, link.linkname = tarfile.SYMTYPE, target
                archive.addfile(link)
            continue
        found = _open_entry(src, child)
        if found is None:
            continue
        fd, child_info = found
        with opened(fd):
            if stat.S_ISDIR(child_info.st_mode):
                _add_tree(archive, fd, child_info, member, budget, depth + 1)
            else:
                _add_file(archive, fd, child_info, member, budget)


def _stays_in_tree(target: str) -> bool:
    """A link target that cannot leave the exported tree, whatever the links around it: relative
    and without `..` (each step only goes down from the link's own directory)."""
    names = target.split("/")
    return bool(target) and not target.startswith("/") and ".." not in names


def _add_file(
    archive: tarfile.TarFile, fd: int, info: os.stat_result, name: str, budget: _Budget
) -> None:
    budget.charge(info.st_size)
    entry = tarfile.TarInfo(name)
    entry.size, entry.mode, entry.mtime = info.st_size, stat.S_IMODE(info.st_mode), info.st_mtime
    os.set_blocking(fd, True)
    archive.addfile(entry, io.BufferedReader(_Exactly(fd, info.st_size), _CHUNK))
