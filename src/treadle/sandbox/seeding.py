"""Put a task's files into a workspace: for evaluation harnesses.

`seed_workspace` copies a directory or unpacks an archive (`.tar`, `.tar.gz`/`.tgz`, `.tar.bz2`,
`.tar.xz`, `.zip`) into a sandbox's workspace, on the sandbox I/O threads. Every write goes
through `treadle.sandbox.beneath` from the workspace's directory fd: a link a command left in an
earlier pass is refused, never written through. Archives are never handed to `extractall`: each
member is checked here (type, name, link target) and written by the same code, because
`tarfile`'s `filter="data"` alone is bypassed on some supported Pythons (CVE-2025-4517 on
3.11.7). This module must never write outside the workspace or follow a link there.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import stat
import tarfile
from pathlib import Path
from typing import IO

from treadle.errors import PathViolation, SandboxError
from treadle.sandbox.beneath import is_link_error, make_dirs_beneath, opened
from treadle.sandbox.isolated import IsolatedBackend
from treadle.sandbox.local import _IO
from treadle.sandbox.opening import Sandbox
from treadle.sandbox.paths import workspace_parts

__all__ = ["ARCHIVE_SUFFIXES", "seed_workspace"]

#: File name endings `seed_workspace` unpacks (anything else must be a directory).
ARCHIVE_SUFFIXES: tuple[str, ...] = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")
_COPY_CHUNK = 1024 * 1024


async def seed_workspace(
    sandbox: Sandbox, source: str | os.PathLike[str], *, into: str = "."
) -> int:
    """Copy directory `source` (links kept as links) or unpack archive `source` into the
    workspace directory `into`; return the number of regular files put there.

    `PathViolation` when `into`, or a member's path, would leave the workspace or pass through a
    link (one a command left there included), or an archive member is a device or a link out.
    """
    count = await _IO.run(_seed, sandbox.workspace, Path(source), into)
    if isinstance(sandbox.backend, IsolatedBackend):
        await sandbox.backend.claim()  # the box's uid must be able to change what was put in
    return count


class _Writer:
    """Writes entries below one directory fd, never through a link."""

    def __init__(self, top: int, label: str) -> None:
        self.top = top
        self.label = label
        self.files = 0

    def _parent(self, parts: tuple[str, ...]) -> int:
        try:
            return make_dirs_beneath(self.top, parts[:-1])
        except OSError as e:
            raise self._refused(parts, e) from None

    def _refused(self, parts: tuple[str, ...], e: OSError) -> SandboxError:
        name = "/".join(parts)
        if is_link_error(e) or e.errno == errno.ENOTDIR:
            return PathViolation(
                f"cannot seed {name!r}: the workspace has a symbolic link or a file on its way "
                f"(left by a command?); clear it first ({self.label})."
            )
        return SandboxError(f"cannot seed {name!r} ({e.strerror}; {self.label}).")

    def _clear(self, parent: int, parts: tuple[str, ...]) -> None:
        """Remove what sits at the name (a link is removed, never followed); refuse a directory."""
        try:
            info = os.lstat(parts[-1], dir_fd=parent)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            raise SandboxError(
                f"cannot seed the file {'/'.join(parts)!r}: the workspace has a directory there."
            )
        os.unlink(parts[-1], dir_fd=parent)

    def directory(self, parts: tuple[str, ...]) -> None:
        """Make the directory `parts` (and its parents)."""
        try:
            os.close(make_dirs_beneath(self.top, parts))
        except OSError as e:
            raise self._refused(parts, e) from None

    def file(self, parts: tuple[str, ...], data: IO[bytes], mode: int) -> None:
        """A new regular file `parts` with `data`'s bytes (a file already there is replaced)."""
        if not parts:
            raise SandboxError(f"cannot seed a file over the workspace directory ({self.label}).")
        with opened(self._parent(parts)) as parent:
            self._clear(parent, parts)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(parts[-1], flags, 0o600, dir_fd=parent)
            except OSError as e:
                raise self._refused(parts, e) from None
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(data, out, _COPY_CHUNK)
                # As the `data` filter does: no setuid/setgid/sticky, no group or other writes.
                os.fchmod(out.fileno(), (mode & 0o755) | 0o600)
        self.files += 1

    def link(self, parts: tuple[str, ...], target: str) -> None:
        """A symbolic link `parts` -> `target` (made, never followed)."""
        if not parts:
            raise SandboxError(f"cannot seed a link over the workspace directory ({self.label}).")
        with opened(self._parent(parts)) as parent:
            self._clear(parent, parts)
            os.symlink(target, parts[-1], dir_fd=parent)


def _seed(root: Path, source: Path, into: str) -> int:
    label = f"seeding from {source}"
    with opened(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)) as root_fd:
        place = workspace_parts(root, into)
        try:
            top = make_dirs_beneath(root_fd, place)
        except OSError as e:
            if is_link_error(e) or e.errno == errno.ENOTDIR:
                raise PathViolation(
                    f"cannot seed into {into!r}: it is or passes through a symbolic link or a file."
                ) from None
            raise SandboxError(f"cannot make {into!r} in the workspace ({e.strerror}).") from None
    with opened(top):
        writer = _Writer(top, label)
        name = source.name.lower()
        if source.is_dir():
            _copy_directory(source, writer)
        elif name.endswith(".zip"):
            _unzip(source, writer)
        elif name.endswith(ARCHIVE_SUFFIXES):
            _untar(source, writer)
        elif not source.exists():
            raise SandboxError(f"cannot seed the workspace: {source} does not exist.")
        else:
            raise SandboxError(
                f"cannot seed the workspace from {source}: give a directory or an archive "
                f"({', '.join(ARCHIVE_SUFFIXES)})."
            )
        return writer.files


def _copy_directory(source: Path, writer: _Writer) -> None:
    """The caller's own directory: regular files, directories and links (as links)."""
    for here, dirs, files in os.walk(source):
        rel = Path(here).relative_to(source).parts
        for name in sorted(dirs + files):
            path = os.path.join(here, name)
            mode = os.lstat(path).st_mode
            parts = (*rel, name)
            if stat.S_ISLNK(mode):
                writer.link(parts, os.readlink(path))
            elif stat.S_ISDIR(mode):
                writer.directory(parts)
            elif stat.S_ISREG(mode):
                with open(path, "rb") as data:
                    writer.file(parts, data, stat.S_IMODE(mode))
            # FIFOs, sockets and devices are skipped (copying a FIFO blocks)


def _member_parts(source: Path, name: str) -> tuple[str, ...]:
    """An archive member's name as plain names below the seed directory, or `PathViolation`."""
    if name.startswith("/"):
        raise PathViolation(
            f"the archive {source} has a member {name!r} that leaves it (absolute)."
        )
    try:
        return workspace_parts(Path("/"), name)  # a relative name: `..` that climbs out refused
    except PathViolation:
        raise PathViolation(f"the archive {source} has a member {name!r} that leaves it.") from None


def _link_stays_inside(parts: tuple[str, ...], target: str) -> bool:
    """True when link `parts` -> `target` names a place inside the seeded tree (by its names)."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname("/".join(parts)), target))
    return joined != ".." and not joined.startswith("../")


def _untar(source: Path, writer: _Writer) -> None:
    try:
        with tarfile.open(source) as archive:
            for member in archive:
                parts = _member_parts(source, member.name)
                if member.isdir():
                    writer.directory(parts)
                elif member.isreg() or member.islnk():
                    # A hard link member is written as a copy of the data it names: no link is
                    # made, so none can point anywhere (tarfile finds the data in the archive).
                    data = archive.extractfile(member)
                    if data is None:
                        raise SandboxError(f"cannot read {member.name!r} from {source}.")
                    with data:
                        writer.file(parts, data, member.mode)
                elif member.issym():
                    if not _link_stays_inside(parts, member.linkname):
                        raise PathViolation(
                            f"the archive {source} has a link {member.name!r} -> "
                            f"{member.linkname!r} that leaves it."
                        )
                    writer.link(parts, member.linkname)
                else:
                    raise PathViolation(
                        f"the archive {source} has a device, FIFO or other special member "
                        f"{member.name!r}; only files, directories and links are unpacked."
                    )
    except (tarfile.TarError, EOFError) as e:
        raise SandboxError(f"cannot unpack {source}: {e}.") from e


def _unzip(source: Path, writer: _Writer) -> None:
    import zipfile  # only a zip seed needs it

    try:
        with zipfile.ZipFile(source) as archive:
            for member in archive.infolist():
                parts = _member_parts(source, member.filename)
                if member.is_dir():
                    writer.directory(parts)
                    continue
                # Zip "links" (a mode bit only a few tools set) are unpacked as files, as
                # zipfile itself does.
                mode = (member.external_attr >> 16) & 0o777 or 0o644
                with archive.open(member) as data:
                    writer.file(parts, data, mode)
    except zipfile.BadZipFile as e:
        raise SandboxError(f"cannot unpack {source}: {e}.") from e
