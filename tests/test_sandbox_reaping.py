"""An isolated command leaves no process behind, zombies included, however it ends.

bubblewrap's monitor used to exit before the box's PID 1 was reaped, leaving it to the machine's
init; where that init reaps late (this machine's) the zombies piled up under the box's uid and,
counted in its `RLIMIT_NPROC`, stopped the box from forking after about `max_processes`
commands. Real boxes; as root only (an ordinary user's box runs as that user, whose other
processes these tests cannot tell apart).
"""

from __future__ import annotations

import functools
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


_REUSED_PID = """
import os, subprocess, sys
from treadle.sandbox.box_reaping import kill_box, open_leader
leader = subprocess.Popen(["/bin/true"], start_new_session=True)  # as `unshare`: a group leader
fd = open_leader(leader.pid)
leader.wait()  # reaped, as after a command's end
with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # the next process gets the leader's pid
    f.write(str(leader.pid - 1))
bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)  # another group's leader
assert bystander.pid == leader.pid, (bystander.pid, leader.pid)
assert kill_box(leader.pid, fd) is False
try:
    bystander.wait(timeout=0.5)
    sys.exit("the bystander that got the reaped leader's pid was killed")
except subprocess.TimeoutExpired:
    bystander.kill()
    bystander.wait()
"""


def test_a_kill_after_the_leader_was_reaped_signals_no_one_by_its_old_number() -> None:
    # In a PID namespace of its own, where the next pid can be set: a new group leader gets the
    # reaped leader's pid, and the kill must leave it be (a `killpg` by number would not).
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _REUSED_PID],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


async def test_a_close_reads_as_a_kill_with_the_commands_output_only(box: Sandbox) -> None:
    # A close kills the box as a timeout does: -9, and stderr holds the command's output only
    # (the namespace init's shell says "Killed" when its child dies by a signal: not there).
    results = []

    async def run() -> None:
        results.append(await box.run_command("echo started >&2; sleep 60"))

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        with anyio.fail_after(10):
            while len(_processes_of(_uid_of(box))) < 4:
                await anyio.sleep(0.01)
        await anyio.to_thread.run_sync(box.backend.close)
    assert (results[0].exit_code, results[0].stderr) == (-signal.SIGKILL, "started\n")


async def test_a_memory_kill_adds_only_its_note() -> None:
    limits = ResourceLimits(max_processes=8, memory_bytes=64 * 1024**2)
    for box in open_sandbox(Isolated(limits=limits)):
        assert isinstance(box.backend, IsolatedBackend)
        if box.backend.memory_group is None:
            pytest.skip("no memory cgroup here")
        result = await box.run_command("head -c 200000000 /dev/zero > /tmp/big")
        assert result.exit_code in (128 + signal.SIGKILL, -signal.SIGKILL), result
        # The command's own shell may outlive `head` (the kernel killed the biggest process
        # only) and say so, as any shell does: that line is the command's output, not Treadle's.
        stderr = result.stderr.removeprefix("Killed\n")
        assert stderr.startswith("\n[treadle: the command was stopped by the box's memory")


async def test_a_command_beyond_the_process_limit_says_so(box: Sandbox) -> None:
    # A running command's box holds 4 processes (bubblewrap's two, the shell, `sleep`) of the 6
    # the limit allows (4 + bubblewrap's 2): the next command cannot start its box, and says
    # why instead of blaming user namespaces (SandboxUnavailable).
    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(box.run_command, "sleep 60", timeout=5))
        with anyio.fail_after(10):
            while len(_processes_of(_uid_of(box))) < 4:
                await anyio.sleep(0.01)
        result = await box.run_command("true")
        group.cancel_scope.cancel()
    assert result.exit_code == 1
    assert "could not start a process: its process limit (max_processes=4)" in result.stderr


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
