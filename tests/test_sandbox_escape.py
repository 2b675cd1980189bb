"""Sandbox escape attempts, against both backends, beyond `tests/test_sandbox_local.py` (which
covers `..`, absolute and symlinked paths, NUL bytes, over-long paths, background jobs, timeouts,
stdout floods and secret environment variables): hard links, dangling links, FIFOs, process
storms, setsid, timeout/cancel/close, host environments and processes, writes outside the
workspace, loopback servers, stderr and binary floods, and escapes attempted by a model through
a whole pass. What only `isolated` stops is a strict xfail on `local` (it is not a boundary);
docs/sandbox.md's table of what each backend stops points at these tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from sandbox_support import BACKENDS, connect_from, open_sandbox
from treadle import Session, run_session_loop
from treadle.errors import PathViolation, SandboxError
from treadle.sandbox import Sandbox
from treadle.sandbox.isolated import _processes_of
from treadle.sandbox.local import MAX_LIST_ENTRIES, MAX_READ_BYTES
from treadle.sandbox.process import MAX_STREAM_BYTES
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_calls


@pytest.fixture
def sandbox(any_sandbox: Sandbox) -> Sandbox:
    """Each test runs against `local` and `isolated` (the file tools are the same code)."""
    return any_sandbox


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "outside.txt"
    secret.write_text("SECRET-OUTSIDE")
    return secret


async def _none_left(survivors: Callable[[str], list[int]], marker: str) -> None:
    with anyio.fail_after(5):  # a bound on waiting for the kernel, not a timing assertion
        while survivors(marker):
            await anyio.sleep(0.01)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def _running_groups(sandbox: Sandbox) -> bool:
    """Whether the sandbox's backend has registered a command as running (both backends keep
    the running commands' process groups, to kill them on close)."""
    return bool(getattr(sandbox.backend, "_groups", None))


def _local_only_xfail(request: pytest.FixtureRequest, sandbox: Sandbox, why: str) -> None:
    """The local backend is not a boundary: what only `isolated` stops is a strict xfail there."""
    if sandbox.backend.name == "local":
        request.applymarker(
            pytest.mark.xfail(reason=f"local is not a boundary: {why}", strict=True)
        )


async def test_hard_link_to_an_outside_file_is_neither_read_nor_written(
    sandbox: Sandbox, outside: Path
) -> None:
    try:
        os.link(outside, sandbox.workspace / "hl")
    except OSError as e:  # protected_hardlinks for non-owners, or another filesystem
        pytest.skip(f"cannot create a hard link here: {e}")
    with pytest.raises(PathViolation, match="hard links"):
        await sandbox.read_file("hl")
    # isolated writes with the box's rights, so the root-owned file is refused even earlier
    with pytest.raises(SandboxError, match=r"hard links|no permission"):
        await sandbox.write_file("hl", "pwned")
    assert await anyio.Path(outside).read_text() == "SECRET-OUTSIDE"


async def test_dangling_and_nested_links_out_are_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    (sandbox.workspace / "dangling").symlink_to(tmp_path / "not-yet")
    await sandbox.write_file("d/.keep", "")  # made by the tool: the box may write in d/
    (sandbox.workspace / "d" / "up").symlink_to("../..")
    for path in ("dangling", "d/up/x", "d/up"):
        with pytest.raises(PathViolation):
            await sandbox.write_file(path, "x")
    assert not (tmp_path / "not-yet").exists()
    with pytest.raises(PathViolation):
        await sandbox.list_files("d/up")
    # A link that stays inside is refused too: following it would need a check a race can undo.
    (sandbox.workspace / "in").symlink_to("d")
    with pytest.raises(PathViolation, match="symbolic link"):
        await sandbox.write_file("in/ok.txt", "ok")
    assert not (sandbox.workspace / "d" / "ok.txt").exists()
    await sandbox.write_file("d/ok.txt", "ok")  # the path the link points to works
    assert (await sandbox.read_file("d/ok.txt")).data == b"ok"


async def test_fifos_do_not_hang_file_tools(sandbox: Sandbox) -> None:
    assert (await sandbox.run_command("mkfifo fifo")).exit_code == 0  # as a hostile command would
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


async def test_a_storm_of_background_processes_dies_with_its_command(
    sandbox: Sandbox, marker: str, survivors: Callable[[str], list[int]]
) -> None:
    # Bounded (50 children, each starting a grandchild): a storm, never a real fork bomb.
    cmd = f"for i in $(seq 50); do (sleep {marker} & sleep {marker}) & done; echo started"
    result = await sandbox.run_command(cmd, timeout=10)
    assert result.exit_code == 0 and "started" in result.stdout
    await _none_left(survivors, marker)


@pytest.fixture
def local_sandbox() -> Iterator[Sandbox]:
    yield from open_sandbox("local")


@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs util-linux prlimit")
async def test_a_process_limit_stops_a_fork_storm_by_hand_on_local(
    local_sandbox: Sandbox, marker: str, survivors: Callable[[str], list[int]]
) -> None:
    """On `local` the limit is the user's to set (prlimit); `isolated` sets one itself (see
    test_sandbox_isolated.py)."""
    sandbox = local_sandbox
    # RLIMIT_NPROC is not enforced for root, so as root the storm runs under a throwaway uid
    # (nobody) whose process count is known to be near zero. The loop is bounded either way.
    storm = f"cd /; echo $$; for i in $(seq 40); do sleep {marker} & echo $!; done; echo finished"
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
    await _none_left(survivors, marker)


async def test_setsid_escapes_the_process_group(
    request: pytest.FixtureRequest,
    sandbox: Sandbox,
    marker: str,
    survivors: Callable[[str], list[int]],
) -> None:
    _local_only_xfail(request, sandbox, "a process that calls setsid() leaves the command's group")
    # Wait until the child has really called setsid() (it writes its pid from the new session);
    # otherwise the group kill can land first and the escape never happens (a flaky XPASS).
    result = await sandbox.run_command(
        f"setsid sh -c 'echo $$ > escaped.pid; exec sleep {marker}' > /dev/null 2>&1 & "
        "while [ ! -s escaped.pid ]; do sleep 0.01; done; cat escaped.pid"
    )
    assert result.stdout.strip().isdigit()
    try:
        await _none_left(survivors, marker)
    finally:
        _kill(survivors(marker))


async def test_timeout_cancel_and_close_kill_everything_in_the_box(
    sandbox: Sandbox, marker: str, survivors: Callable[[str], list[int]]
) -> None:
    slow = f"sleep {marker} & sleep {marker} & wait"
    result = await sandbox.run_command(slow, timeout=0.5)
    assert result.timed_out and result.exit_code == -9
    await _none_left(survivors, marker)
    with anyio.move_on_after(0.5):  # cancelling the caller
        await sandbox.run_command(slow)
    await _none_left(survivors, marker)
    async with anyio.create_task_group() as group:  # closing the sandbox under a running command
        group.start_soon(sandbox.run_command, slow)
        with anyio.fail_after(10):
            # The shell (whose line holds it) and both sleeps, and the command registered as
            # running: its processes run a few loop steps before its start returns, and a close
            # in between is a close at the start (test_sandbox_close_at_start.py).
            while len(survivors(marker)) < 3 or not _running_groups(sandbox):
                await anyio.sleep(0.01)
        await anyio.to_thread.run_sync(sandbox.backend.close)
    await _none_left(survivors, marker)


async def test_no_host_secret_in_any_environment_in_view(
    request: pytest.FixtureRequest, sandbox: Sandbox, marker: str
) -> None:
    _local_only_xfail(request, sandbox, "the shell reads host processes' /proc/<pid>/environ")
    # /proc/<pid>/environ shows the environment a process started with, so the canary goes to a
    # host process started for the purpose (as the API key of the app running Treadle would).
    canary = {"TREADLE_CANARY_API_KEY": "sk-canary-8d1f"}
    async with await anyio.open_process(["sleep", marker], env=canary) as host:
        try:
            result = await sandbox.run_command(
                "env; cat /proc/1/environ /proc/$PPID/environ; "
                "grep -a -h -o 'sk-canary-[0-9a-f]*' /proc/[0-9]*/environ"
            )
        finally:
            host.kill()
    assert "sk-canary" not in result.stdout + result.stderr


async def test_host_processes_are_out_of_view(
    request: pytest.FixtureRequest, sandbox: Sandbox
) -> None:
    _local_only_xfail(request, sandbox, "the shell sees every process on the machine")
    result = await sandbox.run_command(f"test -e /proc/{os.getpid()} && echo visible; ls /proc")
    assert "visible" not in result.stdout
    assert sum(name.isdigit() for name in result.stdout.split()) < 10  # the box's own few


async def test_writes_outside_the_workspace_fail(
    request: pytest.FixtureRequest, sandbox: Sandbox
) -> None:
    _local_only_xfail(request, sandbox, "the shell writes wherever the user can")
    with _outside_targets() as targets:
        await sandbox.run_command("; ".join(f"echo pwned > {p}" for p in targets))
        leaked = [p for p in targets if p.exists()]
    assert leaked == []


@contextlib.contextmanager
def _outside_targets() -> Iterator[list[Path]]:
    """Paths outside the workspace where a write would land on the host: a world-writable
    directory, the system directories and the host's /tmp."""
    directory = Path(tempfile.mkdtemp(prefix="treadle-escape-"))
    directory.chmod(0o777)  # writable for anyone: only the box's mounts may stop the write
    targets = [
        directory / "pwned",
        Path("/usr/pwned"),
        Path("/etc/pwned"),
        Path(f"/tmp/{directory.name}-pwned"),
    ]
    try:
        yield targets
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        for path in targets[1:]:
            path.unlink(missing_ok=True)


async def test_loopback_servers_are_out_of_reach(
    request: pytest.FixtureRequest, sandbox: Sandbox
) -> None:
    _local_only_xfail(request, sandbox, "the shell connects to any port on the machine")
    assert "connected" not in await connect_from(sandbox)


async def test_stderr_and_binary_floods_are_capped(sandbox: Sandbox) -> None:
    result = await sandbox.run_command(
        "head -c 5000000 /dev/urandom >&2; head -c 3000000 /dev/urandom"
    )
    assert result.exit_code == 0
    for text, total in ((result.stderr, 5_000_000), (result.stdout, 3_000_000)):
        assert text.endswith(f"…[truncated {total - MAX_STREAM_BYTES} bytes]")
        assert len(text) < 2 * MAX_STREAM_BYTES  # invalid UTF-8 became replacement characters


@pytest.mark.parametrize("placement", BACKENDS)
def test_escapes_attempted_by_a_model_come_back_as_tool_errors(
    outside: Path, placement: str
) -> None:
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
        user = Session.from_user_message("escape").to(placement)
        out = run_session_loop(user, Session.from_agent_prompt("x"), executor=ex)
        bodies = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    finally:
        del os.environ["TREADLE_TEST_API_KEY"]
    assert out.stop_reason == "final_answer"
    assert [b.get("error_kind") for b in bodies[:5]] == ["path_violation"] * 5
    assert not Path("/tmp/treadle-escape.txt").exists()
    assert bodies[5]["ok"] is True and "sk-env-canary-42" not in bodies[5]["stdout"]
    out.close_sandbox()
