"""The box's bounds where the host provides them: every RAM-backed mount sized or read-only,
memfd and tmpfs pages counted by a memory cgroup, workspaces removed whatever modes a command
left (as an ordinary user), and clear errors when bwrap is gone or too old to size a tmpfs.
docs/sandbox.md's escape table and "what is bounded where" name these tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest

from sandbox_support import needs_bwrap, open_sandbox, run_as_nobody
from treadle.errors import SandboxError, SandboxUnavailable
from treadle.sandbox import Isolated, IsolatedBackend, ResourceLimits, SandboxHandle


@needs_bwrap
async def test_every_ram_backed_mount_in_the_box_is_bounded() -> None:
    limits = ResourceLimits(tmp_bytes=8 * 1024**2)
    for box in open_sandbox(Isolated(limits=limits)):
        result = await box.run_command(
            "echo hi > /dev/null && echo null-ok; "
            "for d in / /dev /dev/shm /tmp; do head -c 50000000 /dev/zero > $d/fill; "
            "echo $d $(stat -c %s $d/fill 2>/dev/null || echo none); done"
        )
        lines = result.stdout.splitlines()
        assert lines[0] == "null-ok"  # devices still work on the read-only /dev
        sizes = dict(line.split() for line in lines[1:])
        assert sizes["/"] == "none" and sizes["/dev"] == "none", result.stderr  # read-only
        assert int(sizes["/dev/shm"]) <= 8 * 1024**2 and int(sizes["/tmp"]) <= 8 * 1024**2
        assert result.stderr.count("Read-only file system") == 2
        assert result.stderr.count("No space left on device") == 2


@needs_bwrap
async def test_bwrap_gone_after_the_box_was_made_is_sandbox_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    bin_dir = Path(tempfile.mkdtemp(prefix="treadle-bin-"))  # a place the box's uid can reach
    try:
        os.chmod(bin_dir, 0o755)
        shutil.copy2(bwrap, bin_dir / "bwrap")  # a bwrap this test may uninstall
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        for box in open_sandbox("isolated"):
            assert (await box.run_command("echo in the box")).stdout == "in the box\n"
            (bin_dir / "bwrap").unlink()  # uninstalled while the box is open
            with pytest.raises(SandboxUnavailable, match="gone since this sandbox was made"):
                await box.run_command("echo again")
    finally:
        shutil.rmtree(bin_dir)


DEEP_TREE = """
import os
for i in range({depth}):
    os.mkdir({name!r}); os.chdir({name!r})
os.mkdir("z"); open("z/f", "w").write("x")
if {lock}:
    os.chmod("z", 0)
"""

_UNWRITABLE_AS_A_USER = """
import asyncio, json
from treadle import Session
from test_sandbox_box_bounds import DEEP_TREE

async def main():
    left = {}
    for placement in ("local", "isolated"):
        async with Session.from_user_message("x").to(placement) as session:
            box = session.require_sandbox()
            result = await box.run_command(
                "mkdir -p a/b/c && touch a/b/c/f a/b/g && chmod 000 a/b/c a/b && chmod 500 a"
            )
            assert result.exit_code == 0, result.stderr
            # 400 levels of 30-letter names (past PATH_MAX), a chmod 000 directory at the bottom
            await box.write_file("deep.py", DEEP_TREE.format(depth=400, name="d" * 30, lock=True))
            result = await box.run_command("python3 deep.py")
            assert result.exit_code == 0, result.stderr
            workspace = box.workspace
        left[placement] = workspace.exists()
    print(json.dumps(left))

asyncio.run(main())
"""


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs the backends as an ordinary user (uid nobody) from root, with setpriv",
)
def test_workspaces_are_removed_whatever_modes_a_command_left() -> None:
    src = Path(__file__).resolve().parent.parent / "src"
    proc = run_as_nobody(
        ["-c", _UNWRITABLE_AS_A_USER],
        pythonpath=f"{src}{os.pathsep}{Path(__file__).parent}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"local": False, "isolated": False}


@needs_bwrap
def test_a_deep_tree_is_removed_on_close_with_the_memory_group() -> None:
    handle = SandboxHandle("isolated")
    box = handle.open()
    group = box.backend.memory_group if isinstance(box.backend, IsolatedBackend) else None

    async def nest() -> None:
        await box.write_file("deep.py", DEEP_TREE.format(depth=1500, name="a", lock=False))
        result = await box.run_command("python3 deep.py", timeout=300)
        assert result.exit_code == 0, result.stderr

    anyio.run(nest)
    workspace = box.workspace
    handle.release()  # off any event loop: the close runs here, so its errors reach us
    assert handle.wait_closed(60)
    assert not os.path.lexists(workspace)
    assert group is None or not group.path.exists()


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("chattr") is None, reason="chattr +i needs root"
)
def test_a_workspace_that_cannot_be_deleted_is_reported_and_its_memory_group_closed() -> None:
    handle = SandboxHandle("isolated")
    box = handle.open()
    group = box.backend.memory_group if isinstance(box.backend, IsolatedBackend) else None
    stuck = box.workspace / "a" / "stuck"
    stuck.parent.mkdir()
    stuck.write_text("x")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        shutil.rmtree(box.workspace)
        pytest.skip("this file system has no immutable attribute")
    try:
        with pytest.raises(SandboxError, match=r"could not delete the workspace .*stuck"):
            handle.release()
        assert stuck.exists()  # left, and said so
        assert group is None or not group.path.exists()
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
        shutil.rmtree(box.workspace)


_MEMFD_HOG = """python3 -c "
import os
fds = []
for i in range(60):
    fd = os.memfd_create('x'); os.write(fd, b'x' * (10 * 1024 * 1024)); fds.append(fd)
print('held', len(fds) * 10, 'MiB')
" """


@needs_bwrap
async def test_memfd_and_tmpfs_pages_count_against_the_box_memory_limit() -> None:
    limits = ResourceLimits(memory_bytes=128 * 1024**2)
    for box in open_sandbox(Isolated(limits=limits)):
        backend = box.backend
        assert isinstance(backend, IsolatedBackend)
        group = backend.memory_group
        if group is None:
            pytest.skip(f"no memory cgroup here: {backend.memory_bound} (see docs/sandbox.md)")
        where = group.path
        hog = await box.run_command(_MEMFD_HOG)  # 600 MiB of memfds under a 128 MiB limit
        assert "held" not in hog.stdout and "memory limit" in hog.stderr, hog
        tmpfs = await box.run_command(
            "head -c 100000000 /dev/zero > /tmp/a && head -c 100000000 /dev/zero > /dev/shm/b "
            "&& echo both held"
        )
        # Whichever process the limit stops (the shell or, on a loaded machine, `head`), the
        # two files never hold their 200 MB: tmpfs pages count against the box's memory.
        assert "both held" not in tmpfs.stdout, tmpfs
        held = await box.run_command("cat /tmp/a /dev/shm/b 2>/dev/null | wc -c")
        assert int(held.stdout.strip() or 0) < 200_000_000, held
        small = await box.run_command("head -c 10000000 /dev/zero > /tmp/a && echo fine")
        assert small.stdout == "fine\n"  # a box under its limit is unaffected
    assert not where.exists()  # the group went with the box


_OLD_BWRAP = """#!/bin/sh
# Stands in for a bubblewrap before 0.8 (none of those can be installed here): its --help has
# no --size.
echo "usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]"
echo "    --tmpfs DEST                 Mount new tmpfs on DEST"
"""


@needs_bwrap
async def test_a_bwrap_without_size_fails_clearly_unless_tmp_is_unbounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bin_dir = Path(tempfile.mkdtemp(prefix="treadle-bin-"))
    try:
        os.chmod(bin_dir, 0o755)  # the box's uid runs it
        (bin_dir / "bwrap").write_text(_OLD_BWRAP)
        os.chmod(bin_dir / "bwrap", 0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        for box in open_sandbox("isolated"):
            with pytest.raises(SandboxUnavailable, match=r"no --size.*tmp_bytes=None"):
                await box.run_command("true")
        unbounded = Isolated(limits=ResourceLimits(tmp_bytes=None))
        for box in open_sandbox(unbounded):
            # Past the check, the stand-in itself runs (and, not being bwrap, only prints).
            result = await box.run_command("true")
            assert result.stdout.startswith("usage: bwrap"), result
    finally:
        shutil.rmtree(bin_dir)


_LOWERED_NOFILE = """
import asyncio, json, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # as a shell's `ulimit -n 64` would
from treadle.sandbox import SandboxHandle
async def main():
    handle = SandboxHandle("isolated"); box = handle.open()
    result = await box.run_command("echo hi; ulimit -n")
    handle.release(); handle.wait_closed(60)
    print(json.dumps([result.exit_code, result.stdout, result.stderr]))
asyncio.run(main())
"""


@needs_bwrap
def test_a_hard_limit_below_open_files_is_clamped_with_a_warning() -> None:
    """A harness started with a lowered hard `RLIMIT_NOFILE` (below `open_files`, 1024) still
    runs commands: the box gets the lower limit, a warning says so, and prlimit's refusal is
    never shown as a command's output."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOWERED_NOFILE],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    exit_code, stdout, stderr = json.loads(proc.stdout.splitlines()[-1])
    assert (exit_code, stdout, stderr) == (0, "hi\n64\n", "")
    assert "limits.open_files is 1024, above this process's hard limit 64" in proc.stderr
