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

import pytest

from sandbox_support import needs_bwrap, open_sandbox
from treadle.errors import SandboxUnavailable
from treadle.sandbox import Isolated, IsolatedBackend, ResourceLimits


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


_UNWRITABLE_AS_A_USER = """
import asyncio, json
from treadle import Session

async def main():
    left = {}
    for placement in ("local", "isolated"):
        async with Session.from_user_message("x").to(placement) as session:
            box = session.require_sandbox()
            result = await box.run_command(
                "mkdir -p a/b/c && touch a/b/c/f a/b/g && chmod 000 a/b/c a/b && chmod 500 a"
            )
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
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", _UNWRITABLE_AS_A_USER],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(src), "TMPDIR": "/tmp", "HOME": "/tmp"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    if proc.returncode != 0 and "Permission denied" in proc.stderr and ".venv" in proc.stderr:
        pytest.skip("uid nobody cannot read this checkout's virtualenv")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"local": False, "isolated": False}


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
            pytest.skip("no writable cgroup v1 memory controller here (see docs/sandbox.md)")
        where = group.path
        hog = await box.run_command(_MEMFD_HOG)  # 600 MiB of memfds under a 128 MiB limit
        assert "held" not in hog.stdout and "memory limit" in hog.stderr, hog
        tmpfs = await box.run_command(
            "head -c 100000000 /dev/zero > /tmp/a; head -c 100000000 /dev/zero > /dev/shm/b; "
            "echo both held"
        )
        assert "both held" not in tmpfs.stdout and "memory limit" in tmpfs.stderr, tmpfs
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
