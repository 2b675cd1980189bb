"""Hostile tests where the host touches a box's files: seeding over links a command left, archives
crafted to climb out (CVE-2025-4517 on Python 3.11.7 included), exports of links, of sparse files
and under a rename-exchange race, and the file tools' check-then-open race as an ordinary user.
The box's own bounds (RAM mounts, memory cgroup, leftovers) are in test_sandbox_box_bounds.py.
Each test places a host file or directory the box must never reach and checks it afterwards;
docs/sandbox.md's escape table names these tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_support import BACKENDS, needs_bwrap, open_sandbox, run_as_nobody
from treadle.errors import PathViolation, SandboxError
from treadle.sandbox import (
    Sandbox,
    export_workspace,
    seed_workspace,
)
from treadle.sandbox.beneath import has_openat2, make_dirs_beneath, open_beneath
from treadle.sandbox.exporting import MAX_EXPORT_ENTRIES

RACE_ROUNDS = 300


@pytest.fixture(params=BACKENDS)
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    yield from open_sandbox(request.param)


@pytest.fixture
def vault(tmp_path: Path) -> Path:
    """A root-only host directory with a secret in it: what the box wants to reach."""
    place = tmp_path / "vault"
    place.mkdir(mode=0o700)
    (place / "secret.txt").write_text("HOST-SECRET")
    os.chmod(place / "secret.txt", 0o600)
    return place


def _tree_holds(directory: Path, text: str) -> bool:
    for here, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(here, name)
            if not os.path.islink(path) and text.encode() in Path(path).read_bytes():
                return True
    return False


# -- seeding ---------------------------------------------------------------------------------


async def test_seeding_never_writes_through_a_link_an_earlier_pass_left(
    sandbox: Sandbox, vault: Path, tmp_path: Path
) -> None:
    # An earlier pass leaves `task -> <root-only host dir>`; the next task's files go to task/.
    made = await sandbox.run_command(f"ln -s {vault} task && ln -s {vault}/keys keys")
    assert made.exit_code == 0, made.stderr
    source = tmp_path / "next"
    (source / "task").mkdir(parents=True)
    (source / "task" / "authorized_keys").write_text("ssh-ed25519 AAAA attacker")
    with pytest.raises(PathViolation, match="symbolic link"):
        await seed_workspace(sandbox, source)
    with pytest.raises(PathViolation, match="symbolic link"):
        await seed_workspace(sandbox, source / "task", into="task")
    # A file seeded over a link replaces the link; the link's target is never opened.
    (source / "keys").write_text("new keys")
    only_keys = tmp_path / "only-keys"
    only_keys.mkdir()
    shutil.copy(source / "keys", only_keys / "keys")
    assert await seed_workspace(sandbox, only_keys) == 1
    assert sorted(os.listdir(vault)) == ["secret.txt"]
    assert (vault / "secret.txt").read_text() == "HOST-SECRET"
    assert not (sandbox.workspace / "keys").is_symlink()


def _cve_2025_4517_archive(path: Path, target_dir: Path) -> None:
    """The published bypass of `filter="data"`: a chain of links longer than PATH_MAX hides a
    climb to `target_dir`, then a hard link through it is overwritten with a regular member."""
    comp = "d" * 247
    steps = "abcdefghijklmnop"
    prefix = ""
    with tarfile.open(path, mode="w") as tar:
        for step in steps:
            directory = tarfile.TarInfo(os.path.join(prefix, comp))
            directory.type = tarfile.DIRTYPE
            tar.addfile(directory)
            link = tarfile.TarInfo(os.path.join(prefix, step))
            link.type, link.linkname = tarfile.SYMTYPE, comp
            tar.addfile(link)
            prefix = os.path.join(prefix, comp)
        long_link = os.path.join("/".join(steps), "l" * 254)
        climb = tarfile.TarInfo(long_link)
        climb.type, climb.linkname = tarfile.SYMTYPE, "../" * len(steps)
        tar.addfile(climb)
        escape = tarfile.TarInfo("escape")
        escape.type, escape.linkname = tarfile.SYMTYPE, long_link + "/.." * 16 + str(target_dir)
        tar.addfile(escape)
        hard = tarfile.TarInfo("flaglink")
        hard.type, hard.linkname = tarfile.LNKTYPE, "escape/secret.txt"
        tar.addfile(hard)
        content = b"overwritten"
        regular = tarfile.TarInfo("flaglink")
        regular.size = len(content)
        tar.addfile(regular, io.BytesIO(content))


async def test_a_crafted_tar_cannot_write_outside_the_workspace(
    sandbox: Sandbox, vault: Path, tmp_path: Path
) -> None:
    evil = tmp_path / "evil.tar"
    _cve_2025_4517_archive(evil, vault)
    with pytest.raises(PathViolation):
        await seed_workspace(sandbox, evil)
    assert (vault / "secret.txt").read_text() == "HOST-SECRET"
    assert sorted(os.listdir(vault)) == ["secret.txt"]


@pytest.mark.parametrize(
    ("member", "kind"),
    [
        ("../../escaped.txt", "file"),
        ("/abs/escaped.txt", "file"),
        ("out", "link-absolute"),
        ("out", "link-climbs"),
        ("dev", "device"),
        ("fifo", "fifo"),
    ],
)
async def test_tar_members_are_checked_one_by_one(
    sandbox: Sandbox, tmp_path: Path, member: str, kind: str
) -> None:
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as archive:
        info = tarfile.TarInfo(member)
        if kind == "file":
            info.size = 3
            archive.addfile(info, io.BytesIO(b"bad"))
        else:
            info.type, info.linkname = {
                "link-absolute": (tarfile.SYMTYPE, "/etc/passwd"),
                "link-climbs": (tarfile.SYMTYPE, "a/../../x"),
                "device": (tarfile.CHRTYPE, ""),
                "fifo": (tarfile.FIFOTYPE, ""),
            }[kind]
            archive.addfile(info)
    with pytest.raises(PathViolation):
        await seed_workspace(sandbox, evil)
    assert not (tmp_path.parent / "escaped.txt").exists()
    assert os.listdir(sandbox.workspace) == []


async def test_a_crafted_zip_is_refused_and_modes_are_tamed(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as archive:
        archive.writestr("ok.txt", "fine")
        archive.writestr("../../escaped.txt", "bad")
    with pytest.raises(PathViolation, match="leaves"):
        await seed_workspace(sandbox, evil)
    assert not (tmp_path.parent / "escaped.txt").exists()
    setuid = tmp_path / "setuid.zip"
    with zipfile.ZipFile(setuid, "w") as archive:
        info = zipfile.ZipInfo("run.sh")
        info.external_attr = (stat.S_IFREG | 0o4777) << 16
        archive.writestr(info, "#!/bin/sh\n")
    assert await seed_workspace(sandbox, setuid) == 1
    assert stat.S_IMODE(os.stat(sandbox.workspace / "run.sh").st_mode) == 0o755


async def test_tar_links_inside_the_tree_and_hard_links_as_copies(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    good = tmp_path / "good.tar"
    with tarfile.open(good, "w") as archive:
        data = tarfile.TarInfo("lib/data.txt")
        data.size = 4
        archive.addfile(data, io.BytesIO(b"data"))
        link = tarfile.TarInfo("current")
        link.type, link.linkname = tarfile.SYMTYPE, "lib/data.txt"
        archive.addfile(link)
        hard = tarfile.TarInfo("copy.txt")
        hard.type, hard.linkname = tarfile.LNKTYPE, "lib/data.txt"
        archive.addfile(hard)
    assert await seed_workspace(sandbox, good) == 2
    assert os.readlink(sandbox.workspace / "current") == "lib/data.txt"
    copy = sandbox.workspace / "copy.txt"
    assert copy.read_text() == "data" and os.stat(copy).st_nlink == 1


def _sym(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def _hard(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


@pytest.mark.parametrize(
    ("members", "named"),
    [
        ([_sym("s", "s"), _hard("h", "s")], "'h' -> 's'"),  # tarfile: RecursionError
        ([_sym("p", "q"), _sym("q", "p"), _hard("h", "p")], "'h' -> 'p'"),
        ([_hard("h", "nope")], "'h' -> 'nope'"),  # tarfile: KeyError
        ([_dir("a"), _dir("a/b"), _sym("a/b/c", "../.."), _sym("x", "a/b/c/..")], "'x'"),
        ([_dir("a"), _dir("a/b"), _sym("x", "a/b/c/.."), _sym("a/b/c", "../..")], "'a/b/c'"),
        ([_dir("d"), _sym("d/l", "."), _sym("up", "d/l/l/l/..")], "'up'"),
    ],
    ids=["self-link", "link-loop", "hard-missing", "through-link", "link-after", "dot-chain"],
)
@pytest.mark.parametrize("into", [".", "sub"])
async def test_tar_links_through_links_and_hard_links_to_no_file_are_refused(
    sandbox: Sandbox, tmp_path: Path, members: list[tarfile.TarInfo], named: str, into: str
) -> None:
    crafted = tmp_path / "crafted.tar"
    with tarfile.open(crafted, "w", format=tarfile.GNU_FORMAT) as archive:
        for member in members:
            archive.addfile(member)
    with pytest.raises(PathViolation, match=named):
        await seed_workspace(sandbox, crafted, into=into)


# -- export ----------------------------------------------------------------------------------


async def test_export_drops_links_out_and_refuses_links_in_the_destination(
    sandbox: Sandbox, vault: Path, tmp_path: Path
) -> None:
    made = await sandbox.run_command(
        f"echo ok > real.txt && ln -s {vault}/secret.txt answer.txt && ln -s real.txt alias && "
        f"mkdir -p sub && ln -s {vault} sub/up && ln -s ../.. climb"
    )
    assert made.exit_code == 0, made.stderr
    out = await export_workspace(sandbox, tmp_path / "results")
    assert sorted(os.listdir(out)) == ["real.txt", "sub"]  # every link dropped
    assert os.listdir(out / "sub") == []
    assert not _tree_holds(out, "HOST-SECRET")
    tarball = await export_workspace(sandbox, tmp_path / "results.tar.gz")
    with tarfile.open(tarball) as archive:
        links = {m.name: m.linkname for m in archive.getmembers() if m.issym()}
        assert links == {"./alias": "real.txt"}  # only the link that cannot leave the tree
    # A second export into a folder where an entry is a link (left by anyone) is refused.
    (out / "sub").rmdir()
    (out / "sub").symlink_to(vault)
    made = await sandbox.run_command("echo x > sub/planted")
    with pytest.raises(PathViolation, match="symbolic link"):
        await export_workspace(sandbox, out)
    os.unlink(out / "sub")
    (out / "real.txt").unlink()
    (out / "real.txt").symlink_to(vault / "secret.txt")
    with pytest.raises(PathViolation, match="symbolic link"):
        await export_workspace(sandbox, out)
    assert sorted(os.listdir(vault)) == ["secret.txt"]
    assert (vault / "secret.txt").read_text() == "HOST-SECRET"
    link_dest = tmp_path / "link.tar.gz"
    link_dest.symlink_to(vault / "secret.txt")
    with pytest.raises(PathViolation, match="symbolic link"):
        await export_workspace(sandbox, link_dest)
    assert (vault / "secret.txt").read_text() == "HOST-SECRET"


async def test_sparse_files_keep_their_holes_and_the_cap_stops_an_export(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    sparse = sandbox.workspace / "sparse.img"
    sparse.write_bytes(b"head")
    os.truncate(sparse, 3 * 1024**3)  # as a box's `truncate -s 3G` would leave it
    out = await export_workspace(sandbox, tmp_path / "out")
    copied = os.stat(out / "sparse.img")
    assert copied.st_size == 3 * 1024**3
    assert copied.st_blocks * 512 < 1024**2  # holes kept: not 3 GiB of host disk
    async with await anyio.open_file(out / "sparse.img", "rb") as f:
        assert await f.read(4) == b"head"
    (sandbox.workspace / "big.bin").write_bytes(b"x" * 200_000)
    with pytest.raises(SandboxError, match="larger than its cap"):
        await export_workspace(sandbox, tmp_path / "capped", max_bytes=100_000)
    with pytest.raises(SandboxError, match="larger than its cap"):  # a tarball counts sizes
        await export_workspace(sandbox, tmp_path / "capped.tar.gz")
    os.unlink(sparse)
    deep = await sandbox.run_command(  # nesting is cheap for a box: a bounded walk, no crash
        "python3 -c \"import os; os.makedirs('/'.join(['n'] * 300))\""
    )
    assert deep.exit_code == 0, deep.stderr
    for dest in ("deep", "deep.tar.gz"):
        with pytest.raises(SandboxError, match="nested deeper than 256"):
            await export_workspace(sandbox, tmp_path / dest, max_bytes=10**9)


async def test_the_export_caps_entries_that_hold_no_bytes(sandbox: Sandbox, tmp_path: Path) -> None:
    # Empty files and directories cost no bytes, so only an entry cap stops a box's flood of them
    # (the default, MAX_EXPORT_ENTRIES, is 100,000; a smaller cap keeps the test quick).
    made = await sandbox.run_command(
        "python3 -c \"import os\nfor i in range(1200): open(f'f{i}', 'w').close()\n"
        "for i in range(300): os.mkdir(f'd{i}')\""
    )
    assert made.exit_code == 0, made.stderr
    for dest in ("many", "many.tar.gz"):
        with pytest.raises(SandboxError, match="more than 1000 entries"):
            await export_workspace(sandbox, tmp_path / dest, max_bytes=4096, max_entries=1000)
    assert len(os.listdir(tmp_path / "many")) <= 1000
    small = await sandbox.run_command("mkdir -p s && cd s && mkdir d1 d2 && touch a b c")
    assert small.exit_code == 0, small.stderr
    with pytest.raises(SandboxError, match="more than 4 entries"):
        await export_workspace(sandbox, tmp_path / "s", path="s", max_entries=4)
    out = await export_workspace(sandbox, tmp_path / "s5", path="s", max_entries=5)
    assert sorted(os.listdir(out)) == ["a", "b", "c", "d1", "d2"]
    assert MAX_EXPORT_ENTRIES == 100_000  # the documented default


_SWAPPER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("d", exist_ok=True)
open("d/secret.txt", "w").write("box data")
os.symlink({target!r}, "l")
open("ready", "w").close()
n = 0
while not os.path.exists("stop"):
    # renameat2(AT_FDCWD, "d", AT_FDCWD, "l", RENAME_EXCHANGE): d and l trade places atomically
    if libc.syscall(316, -100, b"d", -100, b"l", 2) == 0:
        n += 1
print(n)
"""


async def _until_exists(path: Path) -> None:
    with anyio.fail_after(60):  # a bound on the box starting, not a timing assertion
        while not await anyio.Path(path).exists():
            await anyio.sleep(0.01)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the swapper uses x86_64's renameat2")
async def test_export_under_a_rename_exchange_race_copies_only_the_box_files(
    sandbox: Sandbox, vault: Path, tmp_path: Path
) -> None:
    await sandbox.write_file("swap.py", _SWAPPER.format(target=str(vault)))
    swaps: list[str] = []

    async def swapper() -> None:
        result = await sandbox.run_command("python3 swap.py", timeout=600)
        swaps.append(result.stdout.strip() or result.stderr)

    async with anyio.create_task_group() as group:
        group.start_soon(swapper)
        await _until_exists(sandbox.workspace / "ready")
        for i in range(RACE_ROUNDS):
            out = await export_workspace(sandbox, tmp_path / f"out{i}", path=".")
            assert not _tree_holds(out, "HOST-SECRET"), f"round {i} copied the host secret"
            shutil.rmtree(out)
        (sandbox.workspace / "stop").touch()
    assert int(swaps[0]) > 0, swaps  # the race really ran
    assert (vault / "secret.txt").read_text() == "HOST-SECRET"


_CLAIM_SWAPPER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pairs = [(f"x{{i}}/d".encode(), f"x{{i}}/l".encode()) for i in range(64)]
for i in range(64):
    os.makedirs(f"x{{i}}/d/s", exist_ok=True)
    os.symlink({target!r}, f"x{{i}}/l")
open("ready", "w").close()
n = 0
while not os.path.exists("stop"):
    for d, l in pairs:
        # renameat2 RENAME_EXCHANGE: a directory the hand-over is about to enter becomes a link
        if libc.syscall(316, -100, d, -100, l, 2) == 0:
            n += 1
print(n)
"""


def _watch_opens(path: Path) -> tuple[int, Any]:
    """An inotify fd that records every open of `path` (by anyone, root included)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(path), 0x20) >= 0  # IN_OPEN
    return fd, libc


def _opens_seen(fd: int) -> int:
    seen = 0
    while True:
        try:
            seen += len(os.read(fd, 4096)) // 16  # a watch on a file: 16-byte events, no names
        except BlockingIOError:
            return seen


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0 or os.uname().machine != "x86_64",
    reason="the hand-over runs as root only; the swapper uses x86_64's renameat2",
)
@pytest.mark.slow  # a 300-round race loop: `make test-slow`
async def test_the_hand_over_after_seeding_never_opens_a_host_file_under_a_race(
    vault: Path, tmp_path: Path
) -> None:
    source = tmp_path / "task"
    source.mkdir()
    (source / "task.txt").write_text("t")
    canary = vault / "secret.txt"
    watch, _ = _watch_opens(canary)
    swaps: list[str] = []
    try:
        for box in open_sandbox("isolated"):
            await box.write_file("swap.py", _CLAIM_SWAPPER.format(target=str(canary)))

            async def swapper(box: Sandbox = box) -> None:
                result = await box.run_command("python3 swap.py", timeout=600)
                swaps.append(result.stdout.strip() or result.stderr)

            opens = 0
            async with anyio.create_task_group() as group:
                group.start_soon(swapper)
                await _until_exists(box.workspace / "ready")
                for _ in range(RACE_ROUNDS):
                    with contextlib.suppress(SandboxError):  # a refusal is fine, an open is not
                        await seed_workspace(box, source)
                    opens += _opens_seen(watch)
                (box.workspace / "stop").touch()
            assert int(swaps[0]) > 0, swaps  # the race really ran
            assert opens == 0, f"root opened the host file {opens} times"
    finally:
        os.close(watch)
    assert canary.read_text() == "HOST-SECRET" and canary.stat().st_uid == 0


@needs_bwrap
async def test_seeding_hands_over_a_tree_nested_1500_deep(tmp_path: Path) -> None:
    source = tmp_path / "task"
    source.mkdir()
    (source / "task.txt").write_text("t")
    for box in open_sandbox("isolated"):
        nest = "import os\nfor i in range(1500): os.mkdir('a'); os.chdir('a')"
        made = await box.run_command(f'python3 -c "{nest}"')
        assert made.exit_code == 0, made.stderr
        assert await seed_workspace(box, source) == 1
        appended = await box.run_command("echo more >> task.txt && cat task.txt")
        assert appended.stdout == "tmore\n", appended.stderr  # the box owns the seeded file


# -- the file tools' check-then-open race, as an ordinary user -------------------------------

_RACE_AS_A_USER = """
import asyncio, json, os, shutil, sys, tempfile
import anyio
from treadle import Session

SWAPPER = sys.argv[1]
ROUNDS = int(sys.argv[2])

async def main():
    private = tempfile.mkdtemp(prefix="private-")  # the user's own 0700 directory
    with open(os.path.join(private, "secret.txt"), "w") as f:
        f.write("USER-PRIVATE")
    os.chmod(os.path.join(private, "secret.txt"), 0o600)
    async with Session.from_user_message("x").to("isolated") as session:
        box = session.require_sandbox()
        await box.write_file("swap.py", SWAPPER.replace("TARGET", private))
        outcomes = {"read": 0, "refused": 0, "written": 0, "leaked": 0}
        errors = set()
        swaps = []

        async def swapper():
            result = await box.run_command("python3 swap.py", timeout=600)
            swaps.append(result.stdout.strip() or result.stderr)

        async with anyio.create_task_group() as group:
            group.start_soon(swapper)
            with anyio.fail_after(60):
                while not os.path.exists(os.path.join(box.workspace, "ready")):
                    await anyio.sleep(0.01)
            # At least ROUNDS rounds, and on until one got through (on a loaded machine the
            # swapper can sit descheduled in its "link" state for a whole batch of rounds).
            for i in range(20 * ROUNDS):
                if i >= ROUNDS and outcomes["read"] + outcomes["written"] > 0:
                    break
                try:
                    data = (await box.read_file("d/secret.txt")).data
                    outcomes["leaked" if b"PRIVATE" in data else "read"] += 1
                except Exception as e:
                    outcomes["refused"] += 1
                    errors.add(type(e).__name__ + ": " + str(e)[:80])
                try:
                    await box.write_file(f"d/new-{i}.txt", "from the tool")
                    outcomes["written"] += 1
                except Exception as e:
                    outcomes["refused"] += 1
                    errors.add(type(e).__name__ + ": " + str(e)[:80])
            open(os.path.join(box.workspace, "stop"), "w").close()
    print(json.dumps({"outcomes": outcomes, "swaps": swaps, "errors": sorted(errors)[:10],
                      "private": sorted(os.listdir(private)),
                      "secret": open(os.path.join(private, "secret.txt")).read()}))
    shutil.rmtree(private)

asyncio.run(main())
"""


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or os.uname().machine != "x86_64",
    reason="runs the backend as an ordinary user (uid nobody) from root, with setpriv",
)
def test_file_tools_race_as_an_ordinary_user_reaches_no_private_file() -> None:
    src = Path(__file__).resolve().parent.parent / "src"
    swapper = _SWAPPER.format(target="TARGET")
    proc = run_as_nobody(
        ["-c", _RACE_AS_A_USER, swapper, str(RACE_ROUNDS)], pythonpath=str(src), timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    outcomes = report["outcomes"]
    assert int(report["swaps"][0]) > 0, report  # the race really ran
    assert outcomes["leaked"] == 0, report
    assert report["private"] == ["secret.txt"] and report["secret"] == "USER-PRIVATE"
    assert sum(outcomes.values()) >= 2 * RACE_ROUNDS and outcomes["read"] + outcomes["written"] > 0


# -- the resolver itself, both ways -------------------------------------------------------------


@pytest.mark.parametrize("use_openat2", [True, False], ids=["openat2", "walk"])
def test_both_resolvers_refuse_every_link(tmp_path: Path, use_openat2: bool) -> None:
    if use_openat2 and not has_openat2():
        pytest.skip("this kernel has no openat2 (Linux < 5.6)")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("inside")
    (tmp_path / "in").symlink_to("d")
    (tmp_path / "out").symlink_to("/etc")
    (tmp_path / "d" / "last").symlink_to("f")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_beneath(root, ("d", "f"), os.O_RDONLY, use_openat2=use_openat2)
        assert os.read(fd, 10) == b"inside"
        os.close(fd)
        for parts in (("in", "f"), ("out", "passwd"), ("d", "last"), ("out",)):
            with pytest.raises(OSError) as caught:
                open_beneath(root, parts, os.O_RDONLY, use_openat2=use_openat2)
            assert caught.value.errno in (40, 18)  # ELOOP, EXDEV
        with pytest.raises(OSError):
            os.close(make_dirs_beneath(root, ("in", "new")))
        assert not (tmp_path / "d" / "new").exists()
    finally:
        os.close(root)
