"""Put a task's files into a workspace: for evaluation harnesses.

`seed_workspace` copies a directory or unpacks an archive (`.tar`, `.tar.gz`/`.tgz`, `.tar.bz2`,
`.tar.xz`, `.zip`) into a sandbox's workspace, on the sandbox I/O threads. Every write goes
through `treadle.sandbox.beneath` from the workspace's directory fd: a link a command left in an
earlier pass is refused, never written through. Archives are never handed to `extractall`: each
member is checked here (type, name, link target) and written by the same code, because
`tarfile`'s `filter="data"` alone is bypassed on some supported Pythons (CVE-2025-4517 on
3.11.7). A seed is all-or-nothing: it is unpacked into a staging directory and moved into place
only once all of it was accepted (`treadle.sandbox.seed_staging`). This module must never
write outside the workspace or follow a link there.
"""

from __future__ import annotations

import errno
import os
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
from treadle.sandbox.seed_staging import _unwritable, staged

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
    try:
        return await _IO.run(_seed, sandbox.workspace, Path(source), into)
    finally:
        # Also after a failure: whatever a failed move left in place is the box's to change.
        if isinstance(sandbox.backend, IsolatedBackend):
            await sandbox.backend.claim()  # the box's uid must be able to change what was put in


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
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError as e:  # a command ran `chmod 000 .`
        raise _unwritable(root, e) from None
    with opened(root_fd):
        place = workspace_parts(root, into)
        # Unpacked into a staging directory first, moved into place only when all of it was
        # accepted: a refused archive leaves nothing behind (see `seed_staging`).
        with staged(root, root_fd, place, into) as top:
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


class _TarLinks:
    """What the members unpacked so far make of the tree, for checking the next link member.

    A link's target is checked by its names alone, which is only sound when none of the names
    on its way is itself a link: `a/b/c -> ../..` then `x -> a/b/c/..` looks inside by names
    and resolves outside. So a target whose way passes through a link member (before or after
    it in the archive) is refused, and a hard link must name a regular file unpacked before it.
    """

    def __init__(self, source: Path) -> None:
        self.source = source
        self.links: set[tuple[str, ...]] = set()
        self.files: dict[tuple[str, ...], tarfile.TarInfo] = {}
        self.passed: set[tuple[str, ...]] = set()  # names the accepted links' targets go through

    def placed(self, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        """Record what now sits at `parts` (a later member replaces an earlier one)."""
        self.links.discard(parts)
        self.files.pop(parts, None)
        if member.isreg():
            self.files[parts] = member
        elif member.issym():
            self.links.add(parts)

    def symbolic(self, parts: tuple[str, ...], target: str) -> None:
        """Check link `parts` -> `target`: inside the seeded tree, through no other link."""
        refusal = PathViolation(
            f"the archive {self.source} has a link {'/'.join(parts)!r} -> {target!r} that "
            "leaves it or passes through another link."
        )
        if not target or target.startswith("/") or "\0" in target or parts in self.passed:
            raise refusal
        way = list(parts[:-1])
        steps = [step for step in target.split("/") if step and step != "."]
        passed = []
        for i, step in enumerate(steps):
            if step == "..":
                if not way:
                    raise refusal
                way.pop()
            else:
                way.append(step)
            if i < len(steps) - 1:  # a name the way goes through (the last is where it ends)
                here = tuple(way)
                if here in self.links or here == parts:
                    raise refusal
                passed.append(here)
        self.passed.update(passed)

    def hard(self, member: tarfile.TarInfo) -> tarfile.TarInfo:
        """The regular file member a hard link member names (unpacked before it)."""
        target = self.files.get(_member_parts(self.source, member.linkname))
        if target is None:
            raise PathViolation(
                f"the archive {self.source} has a hard link {member.name!r} -> "
                f"{member.linkname!r} that names no regular file unpacked before it."
            )
        return target


def _untar(source: Path, writer: _Writer) -> None:
    links = _TarLinks(source)
    try:
        with tarfile.open(source) as archive:
            for member in archive:
                parts = _member_parts(source, member.name)
                if member.isdir():
                    writer.directory(parts)
                elif member.isreg() or member.islnk():
                    # A hard link member is written as a copy of the data of the file it names:
                    # no link is made, so none can point anywhere; and tarfile is never asked
                    # to find a link's data itself (it follows chains of members, and a loop
                    # of them is a RecursionError).
                    data = archive.extractfile(links.hard(member) if member.islnk() else member)
                    if data is None:
                        raise SandboxError(f"cannot read {member.name!r} from {source}.")
                    with data:
                        writer.file(parts, data, member.mode)
                elif member.issym():
                    links.symbolic(parts, member.linkname)
                    writer.link(parts, member.linkname)
                else:
                    raise PathViolation(
                        f"the archive {source} has a device, FIFO or other special member "
                        f"{member.name!r}; only files, directories and links are unpacked."
                    )
                links.placed(parts, member)
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
