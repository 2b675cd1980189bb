"""Sandbox escape attempts beyond `tests/test_sandbox_local.py` (which covers `..`, absolute and
symlinked paths, NUL bytes, over-long paths, background jobs, timeouts, stdout floods and secret
environment variables): hard links, dangling links, FIFOs, process storms, setsid, stderr and
binary floods, and escapes attempted by a model through a whole pass.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from treadle import Session, run_session_loop
from treadle.errors import PathViolation, SandboxError
from treadle.sandbox import Sandbox, SandboxHandle
from treadle.sandbox.local import MAX_LIST_ENTRIES, MAX_READ_BYTES
from treadle.sandbox.process import MAX_STREAM_BYTES
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_calls


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    handle = SandboxHandle("local")
    try:
        yield handle.open()
    finally:
        handle.release()
        handle.wait_closed(10)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "outside.txt"
    secret.write_text("SECRET-OUTSIDE")
    return secret


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


async def _all_dead(pids: list[int]) -> None:
    with anyio.fail_after(5):  # a bound on waiting for the kernel, not a timing assertion
        while any(_alive(p) for p in pids):
            await anyio.sleep(0.01)


async def test_hard_link_to_an_outside_file_is_neither_read_nor_written(
    sandbox: Sandbox, outside: Path
) -> None:
    try:
        os.link(outside, sandbox.workspace / "hl")
    except OSError as e:  # protected_hardlinks for non-owners, or another filesystem
        pytest.skip(f"cannot create a hard link here: {e}")
    with pytest.raises(PathViolation, match="hard links"):
        await sandbox.read_file("hl")
    with pytest.raises(PathViolation, match="hard links"):
        await sandbox.write_file("hl", "pwned")
    assert await anyio.Path(outside).read_text() == "SECRET-OUTSIDE"


async def test_dangling_and_nested_links_out_are_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    (sandbox.workspace / "dangling").symlink_to(tmp_path / "not-yet")
    (sandbox.workspace / "d").mkdir()
    (sandbox.workspace / "d" / "up").symlink_to("../..")
    for path in ("dangling", "d/up/x", "d/up"):
        with pytest.raises(PathViolation):
            await sandbox.write_file(path, "x")
    assert not (tmp_path / "not-yet").exists()
    with pytest.raises(PathViolation):
        await sandbox.list_files("d/up")
    # A link that stays inside is fine.
    (sandbox.workspace / "in").symlink_to("d")
    await sandbox.write_file("in/ok.txt", "ok")
    assert (sandbox.workspace / "d" / "ok.txt").read_text() == "ok"


async def test_fifos_do_not_hang_file_tools(sandbox: Sandbox) -> None:
    os.mkfifo(sandbox.workspace / "fifo")
    with anyio.fail_after(10):  # before the fix, writing blocked a worker thread forever
        with pytest.raises(SandboxError, match="not a regular file"):
            await sandbox.write_file("fifo", "x")
        with pytest.raises(SandboxError, match="not a regular file"):
            await sandbox.read_file("fifo")


async def test_reads_and_listings_are_capped(sandbox: Sandbox) -> None:
    (sandbox.workspace / "big").write_bytes(b"y" * (MAX_READ_BYTES + 10))
    content = await sandbox.read_file("big")
    assert len(content.data) == MAX_READ_BYTES and content.truncated
    many = sandbox.workspace / "many"
    many.mkdir()
    for i in range(MAX_LIST_ENTRIES + 5):
        (many / f"f{i:05d}").touch()
    assert len(await sandbox.list_files("many")) == MAX_LIST_ENTRIES


async def test_a_storm_of_background_processes_dies_with_its_command(sandbox: Sandbox) -> None:
    # Bounded (50 children, each starting a grandchild): a storm, never a real fork bomb.
    cmd = "for i in $(seq 50); do (sleep 30 & echo $!; sleep 30) & echo $!; done"
    result = await sandbox.run_command(cmd, timeout=10)
    assert result.exit_code == 0
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) >= 50
    await _all_dead(pids)


@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs util-linux prlimit")
async def test_a_process_limit_stops_a_fork_storm(sandbox: Sandbox) -> None:
    # RLIMIT_NPROC is not enforced for root, so as root the storm runs under a throwaway uid
    # (nobody) whose process count is known to be near zero. The loop is bounded either way.
    storm = "cd /; echo $$; for i in $(seq 40); do sleep 30 & echo $!; done; echo finished"
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root, where RLIMIT_NPROC is not enforced, and no setpriv")
        limit = 8 + _processes_of(65534)
        cmd = (
            f"prlimit --nproc={limit}:{limit} setpriv --reuid=65534 --regid=65534 --clear-groups "
            f"/bin/sh -c '{storm}'"
        )
    else:
        limit = 8 + _processes_of(os.getuid())
        cmd = f"prlimit --nproc={limit}:{limit} /bin/sh -c '{storm}'"
    result = await sandbox.run_command(cmd, timeout=20)
    pids = [int(p) for p in result.stdout.split() if p.isdigit()]
    assert "finished" not in result.stdout, "the process limit did not stop the storm"
    assert "fork" in result.stderr.lower()
    assert len(pids) <= limit
    await _all_dead(pids)


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except FileNotFoundError:
                pass
    return count


@pytest.mark.xfail(
    reason="known limitation: a process that calls setsid() leaves the command's process group "
    "and is not killed with it (LocalBackend is confinement, not a security boundary)",
    strict=True,
)
async def test_setsid_escapes_the_process_group(sandbox: Sandbox) -> None:
    # Wait until the child has really called setsid() (it writes its pid from the new session);
    # otherwise the group kill can land first and the escape never happens (a flaky XPASS).
    result = await sandbox.run_command(
        "setsid sh -c 'echo $$ > escaped.pid; exec sleep 30' > /dev/null 2>&1 & "
        "while [ ! -s escaped.pid ]; do sleep 0.01; done; cat escaped.pid"
    )
    pid = int(result.stdout)
    try:
        await _all_dead([pid])
    finally:
        if _alive(pid):
            os.kill(pid, 9)


async def test_stderr_and_binary_floods_are_capped(sandbox: Sandbox) -> None:
    result = await sandbox.run_command(
        "head -c 5000000 /dev/urandom >&2; head -c 3000000 /dev/urandom"
    )
    assert result.exit_code == 0
    for text, total in ((result.stderr, 5_000_000), (result.stdout, 3_000_000)):
        assert text.endswith(f"…[truncated {total - MAX_STREAM_BYTES} bytes]")
        assert len(text) < 2 * MAX_STREAM_BYTES  # invalid UTF-8 became replacement characters


def test_escapes_attempted_by_a_model_come_back_as_tool_errors(outside: Path) -> None:
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("read_workspace_file", {"path": str(outside)}),
        ("read_workspace_file", {"path": "../" * 20 + str(outside).lstrip("/")}),
        ("write_workspace_file", {"path": "/tmp/treadle-escape.txt", "content": "x"}),
        ("write_workspace_file", {"path": "a\x00b", "content": "x"}),
        ("list_workspace_files", {"path": "x/" * 3000}),
        ("run_shell_command", {"cmd": "env"}),
    ]
    ex = ScriptedExecutor([tool_calls(attempts), "done"])
    os.environ["TREADLE_TEST_API_KEY"] = "sk-env-canary-42"
    try:
        user = Session.from_user_message("escape").to("local")
        out = run_session_loop(user, Session.from_agent_prompt("x"), executor=ex)
        bodies = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    finally:
        del os.environ["TREADLE_TEST_API_KEY"]
    assert out.stop_reason == "final_answer"
    assert [b.get("error_kind") for b in bodies[:5]] == ["path_violation"] * 5
    assert not Path("/tmp/treadle-escape.txt").exists()
    assert bodies[5]["ok"] is True and "sk-env-canary-42" not in bodies[5]["stdout"]
    out.close_sandbox()
