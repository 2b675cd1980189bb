"""Seeding is all-or-nothing: every refused archive (and a seed that does not fit what the
workspace holds) leaves the workspace exactly as it was, with no staging directory behind;
an accepted seed merges into existing directories and replaces files and links (never
following one). The refusals themselves are tested in test_sandbox_host_side.py.
"""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandbox_support import BACKENDS, open_sandbox
from test_sandbox_host_side import _cve_2025_4517_archive, _dir, _hard, _sym
from treadle.errors import PathViolation, SandboxError
from treadle.sandbox import Sandbox, seed_workspace


@pytest.fixture(params=BACKENDS)
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    yield from open_sandbox(request.param)


def _file(name: str, data: bytes = b"seeded") -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, io.BytesIO(data)


def _special(name: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info


_Member = tarfile.TarInfo | tuple[tarfile.TarInfo, io.BytesIO]


def _tar(path: Path, bad: list[_Member]) -> None:
    """Good members first (a new directory, a new file, a replacement of an existing file),
    then the refused ones: what the good ones wrote must not stay."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as archive:
        archive.addfile(_dir("newdir"))
        archive.addfile(*_file("newdir/new.txt"))
        archive.addfile(*_file("existing.txt", b"replaced"))
        archive.addfile(*_file("old/added.txt"))
        for member in bad:
            if isinstance(member, tuple):
                archive.addfile(*member)
            else:
                archive.addfile(member)


# Made anew for each test: a member's data stream is read once.
_TAR_CASES: dict[str, Callable[[], list[_Member]]] = {
    "climbs": lambda: [_file("../../escaped.txt")],
    "absolute": lambda: [_file("/abs/escaped.txt")],
    "link-absolute": lambda: [_sym("out", "/etc/passwd")],
    "link-climbs": lambda: [_sym("out", "a/../../x")],
    "device": lambda: [_special("dev", tarfile.CHRTYPE)],
    "fifo": lambda: [_special("fifo", tarfile.FIFOTYPE)],
    "self-link": lambda: [_sym("s", "s"), _hard("h", "s")],
    "link-loop": lambda: [_sym("p", "q"), _sym("q", "p"), _hard("h", "p")],
    "hard-missing": lambda: [_hard("h", "nope")],
    "through-link": lambda: [_dir("a"), _dir("a/b"), _sym("a/b/c", "../.."), _sym("x", "a/b/c/..")],
    "link-after": lambda: [_dir("a"), _dir("a/b"), _sym("x", "a/b/c/.."), _sym("a/b/c", "../..")],
    "dot-chain": lambda: [_dir("d"), _sym("d/l", "."), _sym("up", "d/l/l/l/..")],
}


def _snapshot(root: Path) -> dict[str, str]:
    seen = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(here, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                seen[rel] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                seen[rel] = "dir"
            else:
                seen[rel] = path.read_text()
    return seen


async def _prepared(sandbox: Sandbox) -> dict[str, str]:
    await sandbox.write_file("existing.txt", "original")
    await sandbox.write_file("old/kept.txt", "kept")
    return _snapshot(sandbox.workspace)


def _zip_climbs(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("newdir/new.txt", "seeded")
        archive.writestr("existing.txt", "replaced")
        archive.writestr("../../escaped.txt", "bad")


def _truncated_tar(path: Path) -> None:
    _tar(path, [_file("big.bin", b"x" * 100_000)])
    path.write_bytes(path.read_bytes()[:60_000])  # ends inside a member's data


_OTHER_CASES: dict[str, Callable[[Path], None]] = {
    "zip-climbs": _zip_climbs,
    "tar-truncated": _truncated_tar,
}


@pytest.mark.parametrize("into", [".", "sub"])
@pytest.mark.parametrize("case", [*_TAR_CASES, *_OTHER_CASES, "cve-2025-4517"])
async def test_a_refused_archive_leaves_the_workspace_as_it_was(
    sandbox: Sandbox, tmp_path: Path, case: str, into: str
) -> None:
    before = await _prepared(sandbox)
    suffix = ".zip" if case.startswith("zip") else ".tar"
    archive = tmp_path / f"refused{suffix}"
    if case in _TAR_CASES:
        _tar(archive, _TAR_CASES[case]())
    elif case == "cve-2025-4517":
        vault = tmp_path / "vault"
        vault.mkdir()
        (vault / "secret.txt").write_text("HOST-SECRET")
        _cve_2025_4517_archive(archive, vault)
    else:
        _OTHER_CASES[case](archive)
    with pytest.raises(SandboxError):  # PathViolation is one
        await seed_workspace(sandbox, archive, into=into)
    assert _snapshot(sandbox.workspace) == before  # no staging directory, no partial file


async def test_a_seed_that_does_not_fit_the_workspace_moves_nothing(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    before = await _prepared(sandbox)
    (sandbox.workspace / "old" / "clash").mkdir()  # a directory where the seed has a file
    before["old/clash"] = "dir"
    source = tmp_path / "seed"
    (source / "old").mkdir(parents=True)
    (source / "new.txt").write_text("new")
    (source / "old" / "clash").write_text("a file")
    with pytest.raises(SandboxError, match=r"has a directory there\. Nothing was seeded"):
        await seed_workspace(sandbox, source)
    assert _snapshot(sandbox.workspace) == before
    os.symlink(tmp_path, sandbox.workspace / "sub")  # a link left where the seed goes
    before["sub"] = f"-> {tmp_path}"
    with pytest.raises(PathViolation):
        await seed_workspace(sandbox, source, into="sub")
    assert _snapshot(sandbox.workspace) == before
    assert sorted(os.listdir(tmp_path)) == ["seed"]


async def test_an_accepted_seed_merges_and_replaces_without_following_links(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    await _prepared(sandbox)
    outside = tmp_path / "outside.txt"
    outside.write_text("host")
    os.symlink(outside, sandbox.workspace / "link.txt")
    archive = tmp_path / "good.tar"
    _tar(archive, [_file("link.txt", b"a file now")])
    assert await seed_workspace(sandbox, archive) == 4
    seen = _snapshot(sandbox.workspace)
    assert seen == {
        "existing.txt": "replaced",
        "link.txt": "a file now",
        "newdir": "dir",
        "newdir/new.txt": "seeded",
        "old": "dir",
        "old/kept.txt": "kept",
        "old/added.txt": "seeded",
    }
    assert outside.read_text() == "host"
    assert await seed_workspace(sandbox, archive, into="deeper/still") == 4
    assert (sandbox.workspace / "deeper" / "still" / "newdir" / "new.txt").read_text() == "seeded"
