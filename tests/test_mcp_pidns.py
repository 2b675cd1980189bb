"""The supervisor of a stdio MCP server holds the server's whole process tree in a PID namespace
of its own, so nothing the server does to the supervisor lets a descendant outlive closing: not
SIGKILLing or SIGSTOPping it from inside, not a fork bomb, and SIGKILLing the supervisor from
outside (what the transport does last) ends the whole tree. Without namespaces the supervisor
falls back to a subreaper and says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcp_helpers import GUARD_SECONDS, gone

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PID namespaces are Linux-only")

REAPER = Path(__import__("treadle.mcp.reaper").mcp.reaper.__file__)

# A server that leaves a setsid grandchild ignoring SIGTERM (its host pid in argv[1]), then does
# argv[2] to its own parent (the supervisor, or the namespace's init) and sleeps.
_HOSTILE = """
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(os.readlink("/proc/self"))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(3600)
    os._exit(0)
os.wait()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
if sys.argv[2] != "none":
    os.kill(os.getppid(), getattr(signal, sys.argv[2]))
print("ready", os.environ.get("TREADLE_MCP_CONTAINMENT"), flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(3600)
"""


def _namespaces_work() -> bool:
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(REAPER), "sh", "-c", "echo $TREADLE_MCP_CONTAINMENT"],
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    return done.stdout.strip() == "pidns"


needs_pidns = pytest.mark.skipif(not _namespaces_work(), reason="no PID namespaces here")


def _start(tmp_path: Path, act: str, env: dict[str, str] | None = None) -> tuple[Popen, int]:
    pid_file = tmp_path / "grandchild.pid"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            str(REAPER),
            sys.executable,
            "-c",
            _HOSTILE,
            str(pid_file),
            act,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    assert ready[:1] == ["ready"], proc.stderr.read() if proc.stderr else ready
    return proc, int(pid_file.read_text())


Popen = subprocess.Popen[str]


def _close(proc: Popen) -> None:
    """What the transport does: SIGTERM the group, then SIGKILL it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=2)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=GUARD_SECONDS)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _assert_gone(pid: int) -> None:
    """`pid` has ended; if not, it is killed (no leak from a failing test) and the test fails."""
    if not gone(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"process {pid} outlived closing its supervisor")


@needs_pidns
@pytest.mark.parametrize("act", ["SIGKILL", "SIGSTOP", "none"])
def test_a_server_cannot_free_its_grandchild_by_killing_or_stopping_its_supervisor(
    tmp_path: Path, act: str
) -> None:
    proc, grandchild = _start(tmp_path, act)
    try:
        assert proc.poll() is None  # the signal from inside the namespace did nothing
    finally:
        _close(proc)
    _assert_gone(grandchild)


@needs_pidns
def test_sigkilling_the_supervisor_from_outside_ends_the_whole_tree(tmp_path: Path) -> None:
    proc, grandchild = _start(tmp_path, "none")
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the outer supervisor only, not its group
        proc.wait(timeout=GUARD_SECONDS)
    finally:
        _close(proc)
    _assert_gone(grandchild)


@needs_pidns
def test_the_server_runs_in_a_pid_namespace_as_the_same_user(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            str(REAPER),
            "sh",
            "-c",
            "echo $TREADLE_MCP_CONTAINMENT $$ $(id -u) $(readlink /proc/self)",
        ],
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    containment, inner_pid, uid, host_pid = done.stdout.split()
    assert containment == "pidns" and uid == str(os.getuid())
    assert inner_pid == "2" and int(host_pid) != 2  # pid 1 is the namespace's init


def test_without_namespaces_the_subreaper_fallback_says_so_and_still_reaps(tmp_path: Path) -> None:
    proc, grandchild = _start(tmp_path, "none", env={"TREADLE_MCP_NO_PIDNS": "1"})
    try:
        assert proc.poll() is None
    finally:
        _close(proc)
    _assert_gone(grandchild)
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(REAPER), "sh", "-c", "echo $TREADLE_MCP_CONTAINMENT"],
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
        env={**os.environ, "TREADLE_MCP_NO_PIDNS": "1"},
    )
    assert done.stdout.strip() == "subreaper"
    assert "supervising as a subreaper" in done.stderr


_UID = 54321
_BOMB = """
import os, resource, signal, time
resource.setrlimit(resource.RLIMIT_NPROC, (60, 60))
os.setgid(UID); os.setuid(UID)
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            if os.fork() == 0:
                try:
                    os.setsid()
                except OSError:
                    pass
        except OSError:
            time.sleep(0.01)
    os._exit(0)
print("ready", flush=True)
time.sleep(3600)
""".replace("UID", str(_UID))


def _theirs() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != _UID:
                continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


@needs_pidns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the bomb as its own user")
def test_a_bounded_fork_bomb_does_not_survive_closing(tmp_path: Path) -> None:
    assert _theirs() == [], "a process of the bomb's uid is already running"
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", str(REAPER), sys.executable, "-c", _BOMB],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + GUARD_SECONDS
        while len(_theirs()) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_theirs()) >= 40  # the bomb is at its limit
    finally:
        _close(proc)
    deadline = time.monotonic() + GUARD_SECONDS  # a settle bound, not a speed limit
    while _theirs() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _theirs()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
