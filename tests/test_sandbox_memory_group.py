"""The box's memory cgroup on either hierarchy, and the weaker bound said out loud where there
is none. This machine has cgroup v1's memory controller only (its cgroup2 mount has no memory
controller), so the v2 code runs against a temporary directory laid out like a cgroup2 group;
only the kernel's part is stood in for (`_make_dir` filling a new group with the interface
files the kernel would make). The real v1 limit is `test_sandbox_box_bounds.py::
test_memfd_and_tmpfs_pages_count_against_the_box_memory_limit`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_support import needs_bwrap, open_sandbox, run_as_nobody
from treadle.sandbox import Isolated, IsolatedBackend, ResourceLimits, memory_group
from treadle.sandbox import isolated as isolated_module
from treadle.sandbox.memory_group import CgroupLayout, MemoryGroup, make_memory_group

_KERNEL_FILES = {
    "cgroup.procs": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
}


@pytest.fixture
def cgroup2(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Treadle's own group in a fake cgroup2 mount, with the memory controller available."""
    mount = Path(tempfile.mkdtemp(prefix="treadle-cgroup2-"))
    own = mount / "system.slice" / "treadle.service"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("memory pids\n")
    (own / "cgroup.procs").write_text("")

    def make_dir(path: Path) -> None:
        # Stands in for the kernel: mkdir in cgroupfs makes the group's interface files.
        path.mkdir()
        for name, text in _KERNEL_FILES.items():
            (path / name).write_text(text)

    monkeypatch.setattr(memory_group, "_make_dir", make_dir)
    os.chmod(mount, 0o755)
    yield own
    shutil.rmtree(mount)


def test_a_v2_group_bounds_memory_and_swap(cgroup2: Path) -> None:
    group, bound = make_memory_group("box1", 128 * 1024**2, 4242, CgroupLayout(cgroup2, None))
    assert isinstance(group, MemoryGroup) and group.version == 2
    assert group.path == cgroup2 / "box1"
    assert (group.path / "memory.max").read_text() == str(128 * 1024**2)
    assert (group.path / "memory.swap.max").read_text() == "0"  # swap cannot stretch it
    assert bound.startswith(f"cgroup v2 memory group {group.path}")
    assert group.oom_kills() == 0
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert group.oom_kills() == 2
    # v2 moves a process through cgroup.procs (v1 through tasks: test_v1_...).
    assert group.procs_file == group.path / "cgroup.procs"
    assert group.join_argv()[3:] == [str(group.path / "cgroup.procs")]


def test_v2_enables_the_memory_controller_for_children_when_it_may(cgroup2: Path) -> None:
    (cgroup2 / "cgroup.subtree_control").write_text("")
    group, _ = make_memory_group("box2", 1024**3, 4242, CgroupLayout(cgroup2, None))
    assert group is not None and group.version == 2
    assert (cgroup2 / "cgroup.subtree_control").read_text() == "+memory"


def test_without_a_memory_controller_the_weaker_bound_is_said(cgroup2: Path) -> None:
    (cgroup2 / "cgroup.controllers").write_text("cpu io pids\n")
    group, bound = make_memory_group("box3", 1024**3, 4242, CgroupLayout(cgroup2, None))
    assert group is None
    assert bound.startswith("per process only (RLIMIT_AS 1073741824 bytes")
    assert f"memory controller is not available in {cgroup2}" in bound
    assert not (cgroup2 / "box3").exists()
    group, bound = make_memory_group("box4", 1024**3, 4242, CgroupLayout(None, None))
    assert group is None and "no cgroup file system is mounted" in bound


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="the v2 join as root needs root")
async def test_a_box_joins_a_v2_group_as_root_then_runs_as_its_uid(
    cgroup2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = make_memory_group

    def in_fake_cgroup2(name: str, limit: int, uid: int) -> tuple[MemoryGroup | None, str]:
        return real(name, limit, uid, CgroupLayout(cgroup2, None))

    monkeypatch.setattr(isolated_module, "make_memory_group", in_fake_cgroup2)
    for box in open_sandbox(Isolated(limits=ResourceLimits(memory_bytes=256 * 1024**2))):
        backend = box.backend
        assert isinstance(backend, IsolatedBackend)
        group = backend.memory_group
        assert group is not None and group.version == 2
        assert backend.memory_bound is not None and "cgroup v2" in backend.memory_bound
        result = await box.run_command("echo made > made.txt && echo ran")
        assert result.stdout == "ran\n", result.stderr
        assert (group.path / "cgroup.procs").read_text() == "0\n"  # joined (as root) first
        assert os.stat(box.workspace / "made.txt").st_uid == backend.host_uid  # then the box uid


@needs_bwrap
async def test_the_real_group_here_is_v1_and_says_so() -> None:
    for box in open_sandbox(Isolated(limits=ResourceLimits(memory_bytes=256 * 1024**2))):
        backend = box.backend
        assert isinstance(backend, IsolatedBackend)
        bound = backend.memory_bound or ""
        if backend.memory_group is None:
            assert bound.startswith("per process only"), bound
        else:
            assert bound.startswith(f"cgroup v{backend.memory_group.version} memory group")
            assert backend.memory_group.version == 1  # this machine's cgroup2 has no memory


_AS_A_USER = """
import json, logging
from treadle.sandbox import Isolated, IsolatedBackend
logging.basicConfig(level=logging.WARNING, format="%(message)s")
backend = IsolatedBackend(Isolated())
backend.open()
print(json.dumps({"group": backend.memory_group is not None, "bound": backend.memory_bound}))
backend.close()
"""


@needs_bwrap
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs the backend as an ordinary user (uid nobody) from root, with setpriv",
)
def test_an_ordinary_user_is_told_memory_bytes_is_per_process() -> None:
    src = Path(__file__).resolve().parent.parent / "src"
    proc = run_as_nobody(["-c", _AS_A_USER], pythonpath=str(src), timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["group"] is False
    assert seen["bound"].startswith("per process only")
    assert "memory_bytes is per process only" in proc.stderr  # the warning, once
