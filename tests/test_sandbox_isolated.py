"""The isolated backend: resource limits, network on request, who the box runs as, a missing
`bwrap`, workspace seeding and export, and `treadle.map` over 200 boxes. Real bubblewrap boxes,
real files; the escapes it stops are in `tests/test_sandbox_escape.py` (run on both backends).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

import treadle
from sandbox_support import (
    connect_from,
    is_zombie,
    needs_bwrap,
    open_sandbox,
    processes_with,
    run_as_nobody,
)
from treadle import Session
from treadle.agents import Agent
from treadle.errors import ConfigurationError, PathViolation, SandboxError, SandboxUnavailable
from treadle.llm import Provider
from treadle.sandbox import (
    Isolated,
    IsolatedBackend,
    ResourceLimits,
    Sandbox,
    SandboxHandle,
    export_workspace,
    seed_workspace,
)
from treadle.sandbox.isolated import BOX_UID_BASE, BOX_UID_COUNT
from treadle.testing import FakeOpenAIServer

pytestmark = needs_bwrap


@pytest.fixture
def box() -> Iterator[Sandbox]:
    yield from open_sandbox("isolated")


@pytest.fixture
def tight_box() -> Iterator[Sandbox]:
    limits = ResourceLimits(
        cpu_seconds=1, memory_bytes=256 * 1024**2, max_processes=8, file_size_bytes=1_000_000
    )
    yield from open_sandbox(Isolated(limits=limits))


async def test_commands_see_the_workspace_and_read_only_system(box: Sandbox) -> None:
    assert box.backend.name == "isolated"
    await box.write_file("in/task.txt", "from the host\n")
    result = await box.run_command(
        "pwd; cat in/task.txt; echo from the box >> in/task.txt; python3 -c 'print(6 * 7)'; "
        "touch /usr/x /etc/x; echo tmp > /tmp/t && cat /tmp/t"
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == ["/workspace", "from the host", "42", "tmp"]
    assert result.stderr.count("Read-only file system") == 2
    content = await box.read_file("in/task.txt")
    assert content.data == b"from the host\nfrom the box\n"


async def test_the_box_runs_unprivileged_without_capabilities(box: Sandbox) -> None:
    result = await box.run_command("id -u; grep CapEff /proc/self/status; touch made-here")
    uid, caps = result.stdout.splitlines()
    assert uid != "0" and caps.split() == ["CapEff:", "0000000000000000"]
    assert isinstance(box.backend, IsolatedBackend)
    owner = os.stat(box.workspace / "made-here").st_uid
    assert owner == box.backend.host_uid
    if os.geteuid() == 0:  # a uid of its own, never root's
        assert BOX_UID_BASE <= owner < BOX_UID_BASE + BOX_UID_COUNT


async def test_network_on_request_reaches_loopback() -> None:
    for sandbox in open_sandbox(Isolated(network=True)):
        assert "connected b'hi'" in await connect_from(sandbox)


async def test_a_bounded_fork_storm_ends_with_a_clear_error(
    tight_box: Sandbox, marker: str, survivors: Callable[[str], list[int]]
) -> None:
    result = await tight_box.run_command(
        f"for i in $(seq 40); do sleep {marker} & done; echo finished", timeout=20
    )
    assert "finished" not in result.stdout and result.exit_code != 0
    assert "fork" in result.stderr.lower()
    assert survivors(marker) == []


async def test_a_memory_hog_ends_with_a_clear_error(tight_box: Sandbox) -> None:
    result = await tight_box.run_command("python3 -c 'x = bytearray(1024**3)'")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


async def test_cpu_and_file_size_limits_say_which_limit_stopped_the_command(
    tight_box: Sandbox,
) -> None:
    spin = await tight_box.run_command("while :; do :; done", timeout=30)
    assert not spin.timed_out and spin.exit_code == 128 + 24  # SIGXCPU after 1 s of CPU
    assert spin.stderr.endswith("stopped by the box's CPU-time limit (1 s)]")
    big = await tight_box.run_command("head -c 2000000 /dev/zero > big")
    assert big.exit_code == 128 + 25  # SIGXFSZ
    assert "file-size limit (1000000 bytes)" in big.stderr
    assert (tight_box.workspace / "big").stat().st_size == 1_000_000


def test_a_missing_bwrap_names_the_package_and_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without bwrap (or anything else)
    with pytest.raises(SandboxUnavailable, match="bubblewrap") as raised:
        Session.from_user_message("x").to("isolated")
    assert "apt-get install -y bubblewrap" in str(raised.value)
    assert "macOS" in str(raised.value)


def test_bad_options_are_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="absolute"):
        Isolated(read_only=("relative/dir",))
    with pytest.raises(ConfigurationError, match="tuple"):
        Isolated(writable="/srv")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="positive"):
        ResourceLimits(max_processes=0)
    with pytest.raises(ConfigurationError, match="placement"):
        Session.from_user_message("x").to(42)  # type: ignore[arg-type]


@pytest.fixture
def shared() -> Iterator[Path]:
    """Host directories `ro/` (with data.txt) and `rw/` the box's uid can reach (pytest's own
    temporary directories are private to root)."""
    root = Path(tempfile.mkdtemp(prefix="treadle-mounts-"))
    root.chmod(0o755)
    (root / "ro").mkdir()
    (root / "rw").mkdir(mode=0o777)
    (root / "rw").chmod(0o777)
    (root / "ro" / "data.txt").write_text("reference")
    yield root
    shutil.rmtree(root)


async def test_extra_mounts_are_read_only_or_writable_as_asked(shared: Path) -> None:
    options = Isolated(read_only=(str(shared / "ro"),), writable=(str(shared / "rw"),))
    for sandbox in open_sandbox(options):
        result = await sandbox.run_command(
            f"cat {shared}/ro/data.txt; echo x > {shared}/ro/new; echo out > {shared}/rw/result.txt"
        )
        assert result.stdout == "reference"
        assert "Read-only file system" in result.stderr
    assert (shared / "rw" / "result.txt").read_text() == "out\n"
    assert not (shared / "ro" / "new").exists()


def _task_dir(tmp_path: Path) -> Path:
    task = tmp_path / "task"
    (task / "src").mkdir(parents=True)
    (task / "src" / "main.py").write_text("print('fixed' if open('flag').read() else 'broken')\n")
    (task / "flag").write_text("")
    return task


@pytest.mark.parametrize("kind", ["directory", "tar.gz", "zip"])
async def test_seed_run_and_export_like_a_harness(box: Sandbox, tmp_path: Path, kind: str) -> None:
    task = _task_dir(tmp_path)
    source = task
    if kind == "tar.gz":
        source = tmp_path / "task.tar.gz"
        with tarfile.open(source, "w:gz") as archive:
            archive.add(task, arcname=".")
    elif kind == "zip":
        source = tmp_path / "task.zip"
        with zipfile.ZipFile(source, "w") as archive:
            for path in sorted(task.rglob("*")):
                archive.write(path, path.relative_to(task).as_posix())
    assert await seed_workspace(box, source) == 2
    before = await box.run_command("python3 src/main.py")
    assert before.stdout == "broken\n"
    fix = await box.run_command("echo 1 > flag && python3 src/main.py > result.txt && mkfifo pipe")
    assert fix.exit_code == 0, fix.stderr
    out = await export_workspace(box, tmp_path / "out")
    assert (out / "result.txt").read_text() == "fixed\n"
    assert not (out / "pipe").exists()  # FIFOs are skipped, never opened
    tarball = await export_workspace(box, tmp_path / "out.tar.gz")
    with tarfile.open(tarball) as archive:
        assert archive.extractfile("./result.txt").read() == b"fixed\n"  # type: ignore[union-attr]


async def test_archives_that_climb_out_are_refused(box: Sandbox, tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as archive:
        info = tarfile.TarInfo("../../escaped.txt")
        info.size = 3
        archive.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(PathViolation, match="leaves"):
        await seed_workspace(box, evil)
    assert not (box.workspace.parent.parent / "escaped.txt").exists()
    with pytest.raises(SandboxError, match="does not exist"):
        await seed_workspace(box, tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SandboxError, match="directory or an archive"):
        await seed_workspace(box, tmp_path / "notes.txt")


@pytest.mark.slow  # a load test, 200 boxes: `make test-slow`
def test_map_over_200_items_each_in_its_own_box_leaves_no_box() -> None:
    with FakeOpenAIServer(script="file_worker") as server:
        agent = Agent(
            "worker", "Use tools.", provider=Provider(model="fake", base_url=server.base_url)
        )
        items = [Session.from_user_message(f"task {i}").to("isolated") for i in range(200)]
        outs = treadle.map(agent, items, concurrency=50)
    handles = [out.sandbox_handle for out in outs]
    assert all(h is not None for h in handles)
    workspaces = {h.sandbox.workspace for h in handles if h is not None and h.sandbox is not None}
    assert len(workspaces) == 200  # a box (and a workspace) each
    for out in outs:
        assert out.stop_reason == "final_answer"
        assert out.rows[-1].payload["content"] == "notes.txt contains: hello from treadle"
    for session in [*items, *outs]:
        session.close_sandbox()
    assert all(h is not None and h.wait_closed(10) for h in handles)
    assert not any(w.exists() for w in workspaces)
    assert _box_processes(workspaces) == []


def _box_processes(workspaces: set[Path]) -> list[int]:
    """Host pids of live processes of the boxes whose workspaces are `workspaces`.

    A process is a box's when it runs as a box uid (unprivileged: is a bwrap) and its mount
    table binds one of those workspaces: other boxes on the machine (other tests in other
    pytest-xdist workers, other checkouts) are not this test's business, and counting them made
    the test fail whenever one was open. Zombies do not count: a box's PID 1 outlives bwrap's
    monitor by a moment and is then the host init's to reap.
    """
    names = [str(w).encode() for w in workspaces]
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.geteuid() == 0:
                uid = os.stat(f"/proc/{entry}").st_uid
                if not BOX_UID_BASE <= uid < BOX_UID_BASE + BOX_UID_COUNT:
                    continue
            elif int(entry) not in processes_with("bwrap"):
                continue
            with open(f"/proc/{entry}/mountinfo", "rb") as f:
                mounts = f.read()
            zombie = is_zombie(entry)
        except (OSError, IndexError):  # gone, or exiting (its mountinfo reads as EINVAL)
            continue
        if not zombie and any(name in mounts for name in names):
            found.append(int(entry))
    return found


def test_a_handle_closes_its_box_on_release() -> None:
    handle = SandboxHandle("isolated")
    assert handle.placement == "isolated" and isinstance(handle._backend, IsolatedBackend)
    workspace = handle.open().workspace
    handle.release()
    assert handle.wait_closed(10) and not workspace.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only as root does the box run as another uid")
async def test_a_workspace_the_box_cannot_reach_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    os.chmod(tmp_path, 0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # workspaces under a root-only dir
    for sandbox in open_sandbox("isolated"):
        with pytest.raises(SandboxUnavailable, match="reach the workspace"):
            await sandbox.run_command("true")


@pytest.mark.skipif(os.geteuid() != 0, reason="only as root do file tools change uid")
async def test_file_tools_act_with_the_box_rights_while_a_command_swaps_links(box: Sandbox) -> None:
    """A command swaps `d` for a link to /etc while the host writes `d/...` and reads `d/shadow`:
    whichever side of the check the swap lands, the tool acts as the box's uid (not root)."""
    await box.write_file("d/keep", "x")
    swap = (  # as fast as the box can, going on whatever the host does meanwhile
        'python3 -c "import os, time\n'
        "end = time.monotonic() + 20\n"
        "while time.monotonic() < end:\n"
        "    try:\n"
        "        os.rename('d', 'd.real'); os.symlink('/etc', 'd'); os.unlink('d');"
        " os.rename('d.real', 'd')\n"
        "    except OSError:\n"
        "        os.system('rm -rf d d.real; mkdir d')\""
    )
    leaked: list[bytes] = []
    written = 0

    async def tools() -> None:
        nonlocal written
        for i in range(2000):
            with contextlib.suppress(SandboxError, OSError):
                await box.write_file(f"d/pwned-{i}", "x")
                written += 1
            with contextlib.suppress(SandboxError, OSError):
                leaked.append((await box.read_file("d/shadow")).data)

    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(box.run_command, swap, timeout=60))
        await tools()
        group.cancel_scope.cancel()
    assert not any(name.startswith("pwned-") for name in os.listdir("/etc"))
    assert leaked == [] and written > 0


_AS_A_USER = """
import asyncio, json
from treadle import Isolated, ResourceLimits, Session

async def main():
    limits = ResourceLimits(max_processes=8)
    async with Session.from_user_message("x").to(Isolated(limits=limits)) as session:
        box = session.require_sandbox()
        await box.write_file("a.txt", "from the host")
        done = await box.run_command("id -u; cat a.txt; echo; echo more >> a.txt")
        storm = await box.run_command("for i in $(seq 40); do sleep 1 & done; echo finished")
        data = (await box.read_file("a.txt")).data.decode()
        print(json.dumps([done.stdout, storm.stdout, storm.stderr, data]))

asyncio.run(main())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs the backend as an ordinary user (uid nobody) from root, with setpriv",
)
def test_an_ordinary_user_gets_the_same_box(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parent.parent / "src"
    proc = run_as_nobody(["-c", _AS_A_USER], pythonpath=str(src), timeout=120)
    assert proc.returncode == 0, proc.stderr
    done, storm_out, storm_err, data = json.loads(proc.stdout)
    assert done == "1000\nfrom the host\n"
    assert "finished" not in storm_out and "fork" in storm_err.lower()
    assert data == "from the hostmore\n"
