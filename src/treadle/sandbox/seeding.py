"""Put a task's files into a workspace and take the results out: for evaluation harnesses.

`seed_workspace` copies a directory or unpacks an archive (`.tar`, `.tar.gz`/`.tgz`, `.tar.bz2`,
`.tar.xz`, `.zip`) into a sandbox's workspace; `export_workspace` copies the workspace (or a
part) to a host directory or a `.tar.gz`. Both work for every backend and run on the sandbox I/O
threads. Neither ever writes outside the workspace (archive members that climb out, absolute
names, device files and links out are refused) nor follows a link or opens a FIFO the sandbox
left behind.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from pathlib import Path

from treadle.errors import PathViolation, SandboxError
from treadle.sandbox.isolated import IsolatedBackend
from treadle.sandbox.local import _IO
from treadle.sandbox.opening import Sandbox
from treadle.sandbox.paths import resolve_in_workspace

__all__ = ["ARCHIVE_SUFFIXES", "export_workspace", "seed_workspace"]

#: File name endings `seed_workspace` unpacks (anything else must be a directory).
ARCHIVE_SUFFIXES: tuple[str, ...] = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")


async def seed_workspace(
    sandbox: Sandbox, source: str | os.PathLike[str], *, into: str = "."
) -> int:
    """Copy directory `source` (links kept as links) or unpack archive `source` into the
    workspace directory `into`; return the number of regular files put there."""
    target = await _IO.run(_target_dir, sandbox.workspace, into)
    count = await _IO.run(_seed, Path(source), target)
    if isinstance(sandbox.backend, IsolatedBackend):
        await sandbox.backend.claim()  # the box's uid must be able to change what was put in
    return count


async def export_workspace(
    sandbox: Sandbox, dest: str | os.PathLike[str], *, path: str = "."
) -> Path:
    """Copy the workspace directory `path` to host directory `dest` (merged into it if it exists),
    or to a gzipped tarball when `dest` ends in `.tar.gz`/`.tgz`; return `dest`.

    Only regular files, directories and links (as links) are copied; FIFOs, sockets and devices
    the sandbox made are skipped.
    """
    source = await _IO.run(resolve_in_workspace, sandbox.workspace, path)
    out = Path(dest)
    await _IO.run(_export, source, out)
    return out


def _target_dir(root: Path, into: str) -> Path:
    target = resolve_in_workspace(root, into)
    target.mkdir(parents=True, exist_ok=True)
    resolve_in_workspace(root, str(target))  # swapped for a link meanwhile: refuse
    return target


def _seed(source: Path, target: Path) -> int:
    name = source.name.lower()
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True, ignore=_specials)
    elif name.endswith(".zip"):
        _unzip(source, target)
    elif name.endswith(ARCHIVE_SUFFIXES):
        try:
            with tarfile.open(source) as archive:
                archive.extractall(target, filter="data")
        except tarfile.FilterError as e:
            raise PathViolation(f"the archive {source} has a member that leaves it ({e}).") from e
        except tarfile.TarError as e:
            raise SandboxError(f"cannot unpack {source}: {e}.") from e
    elif not source.exists():
        raise SandboxError(f"cannot seed the workspace: {source} does not exist.")
    else:
        raise SandboxError(
            f"cannot seed the workspace from {source}: give a directory or an archive "
            f"({', '.join(ARCHIVE_SUFFIXES)})."
        )
    return sum(len(files) for _, _, files in os.walk(target))


def _unzip(source: Path, target: Path) -> None:
    import zipfile  # only a zip seed needs it

    try:
        with zipfile.ZipFile(source) as archive:
            for member in archive.infolist():
                # zipfile strips `..` and leading slashes itself; this makes the rule explicit.
                resolve_in_workspace(target, member.filename)
            archive.extractall(target)
    except zipfile.BadZipFile as e:
        raise SandboxError(f"cannot unpack {source}: {e}.") from e


def _specials(directory: str, names: list[str]) -> set[str]:
    """Names that are neither regular files, directories nor links (copying a FIFO blocks)."""
    skipped = set()
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            skipped.add(name)
    return skipped


def _export(source: Path, dest: Path) -> None:
    if dest.name.endswith((".tar.gz", ".tgz")):
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(dest, "w:gz") as archive:
            archive.add(source, arcname=".", filter=_regular_members)
    elif source.is_dir():
        shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True, ignore=_specials)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest, follow_symlinks=False)


def _regular_members(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return member if member.isreg() or member.isdir() or member.issym() else None
