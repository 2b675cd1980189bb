"""An isolated command leaves no process behind, zombies included, however it ends.

bubblewrap's monitor used to exit before the box's PID 1 was reaped, leaving it to the machine's
init; where that init reaps late (this machine's) the zombies piled up under the box's uid and,
counted in its `RLIMIT_NPROC`, stopped the box from forking after about `max_processes`
commands. Real boxes; as root only (an ordinary user's box runs as that user, whose other
processes these tests cannot tell apart).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import pytest

from sandbox_support import needs_bwrap, open_sandbox
from treadle.sandbox import Isolated, IsolatedBackend, ResourceLimits, Sandbox
from treadle.sandbox.box_reaping import kill_box, open_leader

pytestmark = [
    needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="only as root does a box have a uid of its own"),
]

#: A few processes: commands that each left one (zombie or not) would run out within the test.
_TIGHT = ResourceLimits(max_processes=4)


@pytest.fixture
def box() -> Iterator[Sandbox]:
    yield from open_sandbox(Isolated(limits=_TIGHT))


def _uid_of(sandbox: Sandbox) -> int:
    assert isinstance(sandbox.backend, IsolatedBackend)
    return sandbox.backend.host_uid


def _processes_of(uid: int) -> list[str]:
    """`pid state name` of every process of `uid`, zombies included."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                name, _, rest = f.read().partition("(")[2].rpartition(")")
            found.append(f"{entry} {rest.split()[0]} {name}")
        except OSError:
            continue
    return found


async def test_many_more_commands_than_the_process_limit_all_run_and_leave_nothing(
    box: Sandbox,
) -> None:
    uid = _uid_of(box)
    for i in range(5 * (4 + 2)):  # five times what the box's limit holds, bwrap's two included
        result = await box.run_command("true")
        assert result.exit_code == 0, (i, result)
        assert _processes_of(uid) == [], i  # reaped before the command was reported done


async def test_statuses_come_through_the_namespace_init(box: Sandbox) -> None:
    assert (await box.run_command("exit 3")).exit_code == 3
    assert (await box.run_command("kill -9 $$")).exit_code == 128 + signal.SIGKILL
    result = await box.run_command("echo out; echo err >&2")
    assert (result.stdout, result.stderr) == ("out\n", "err\n")  # nothing of the init's added


async def test_a_timeout_a_cancellation_and_a_close_leave_nothing(box: Sandbox) -> None:
    uid = _uid_of(box)
    slow = "sleep 60 & sleep 60 & wait"
    for _ in range(4):  # more kills than the limit holds: none leaves a zombie of the box's uid
        result = await box.run_command(slow, timeout=0.3)
        assert result.timed_out and result.exit_code == -signal.SIGKILL, result
        assert _processes_of(uid) == []
    for _ in range(4):
        with anyio.move_on_after(0.3):
            await box.run_command(slow)
        assert _processes_of(uid) == []
    async with anyio.create_task_group() as group:
        group.start_soon(box.run_command, slow)
        with anyio.fail_after(10):
            while len(_processes_of(uid)) < 5:  # bwrap's two, the shell and both sleeps
                await anyio.sleep(0.01)
        await anyio.to_thread.run_sync(box.backend.close)
    with anyio.fail_after(10):  # close kills; the command's own task reaps what it started
        while _processes_of(uid):
            await anyio.sleep(0.01)


def test_a_kill_signals_only_the_leaders_own_grandchildren() -> None:
    # A leader whose child has a child (as unshare, the namespace's init and bubblewrap's
    # monitor): the kill stops the grandchild alone, and the leader ends by itself.
    script = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    leader = subprocess.Popen(
        [sys.executable, "-c", script, "/bin/sh", "-c", "sleep 60; exit $?"],
        start_new_session=True,
    )
    try:
        leader_fd = open_leader(leader.pid)
        assert leader_fd is not None
        while not _grandchildren(leader.pid):
            time.sleep(0.01)  # the chain is starting
        kill_box(leader.pid, leader_fd)
        assert leader.wait(timeout=30) == 128 + signal.SIGKILL  # the shell saw `sleep` killed
        os.close(leader_fd)
    finally:
        leader.kill()
        leader.wait()


def test_a_kill_after_the_leader_was_reaped_signals_no_one_by_its_old_pid() -> None:
    leader = subprocess.Popen(["/bin/true"], start_new_session=True)
    leader_fd = open_leader(leader.pid)
    assert leader_fd is not None
    leader.wait()
    bystander = subprocess.Popen(["sleep", "60"])  # may even get the old pid one day
    try:
        kill_box(leader.pid, leader_fd)  # the group is gone: nothing to kill, no error
        assert bystander.poll() is None
    finally:
        os.close(leader_fd)
        bystander.kill()
        bystander.wait()


def _grandchildren(pid: int) -> list[int]:
    children = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/task/{child}/children") as g:
                    children += [int(c) for c in g.read().split()]
    except OSError:
        pass
    return children
