"""A sandbox closed while a command is starting: the command raises the closed-sandbox error.

A close kills the commands it knows of (they read -9, see `test_sandbox_reaping.py`); one still
starting is not known yet, and used to meet a removed workspace (a raw `FileNotFoundError` from
the spawn, bubblewrap's own error on stderr) or a removed memory cgroup (the join's error as its
result). The races are driven by wrapping `treadle.sandbox.process._spawn`, the start's one call
point: the close runs right before it, or right after it and before the command is registered.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread
import pytest

import treadle.sandbox.local as local_module
import treadle.sandbox.process as process_module
from sandbox_support import BACKENDS, needs_bwrap, open_sandbox, processes_with
from treadle.errors import SandboxError
from treadle.sandbox import Isolated, IsolatedBackend, LocalBackend, ResourceLimits, Sandbox

_Spawn = Callable[..., Awaitable[anyio.abc.Process]]


@pytest.fixture(params=BACKENDS)
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    yield from open_sandbox(request.param)


def _backend(sandbox: Sandbox) -> LocalBackend:
    assert isinstance(sandbox.backend, LocalBackend)
    return sandbox.backend


def _assert_closed_at_start(error: pytest.ExceptionInfo[SandboxError]) -> None:
    assert type(error.value) is SandboxError
    assert "closed while the command was starting" in str(error.value)


def _removed(path: Path) -> bool:
    return not path.exists()


def _command(marker: str) -> str:
    return f"echo started; echo noise >&2; sleep {marker}"


async def _assert_nothing_left(backend: LocalBackend, root: Path, marker: str) -> None:
    while processes_with(marker):  # killed: the kernel lets the orphaned `sleep` go soon
        await anyio.sleep(0.01)
    assert _removed(root)
    assert backend._groups == set()
    if isinstance(backend, IsolatedBackend):
        assert backend._leaders == {} and backend._killed == set()  # pidfds closed
        if backend._own_uid:
            assert _processes_of(backend.host_uid) == []


def _processes_of(uid: int) -> list[str]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                found.append(entry)
        except OSError:
            continue
    return found


async def test_a_close_right_before_the_spawn_raises_the_closed_error(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    backend = _backend(sandbox)
    root = backend.workspace
    real_spawn: _Spawn = process_module._spawn

    async def close_then_spawn(*args: object, **kwargs: object) -> anyio.abc.Process:
        await anyio.to_thread.run_sync(backend.close)  # as a close from another thread does
        return await real_spawn(*args, **kwargs)

    monkeypatch.setattr(process_module, "_spawn", close_then_spawn)
    with pytest.raises(SandboxError) as error:
        await sandbox.run_command(_command(marker))
    _assert_closed_at_start(error)
    await _assert_nothing_left(backend, root, marker)


async def test_a_close_between_the_spawn_and_the_registration_raises_the_closed_error(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    backend = _backend(sandbox)
    root = backend.workspace
    real_spawn: _Spawn = process_module._spawn

    async def spawn_then_close(*args: object, **kwargs: object) -> anyio.abc.Process:
        process = await real_spawn(*args, **kwargs)
        await anyio.to_thread.run_sync(backend.close)
        return process

    monkeypatch.setattr(process_module, "_spawn", spawn_then_close)
    with pytest.raises(SandboxError) as error:
        await sandbox.run_command(_command(marker))
    _assert_closed_at_start(error)
    await _assert_nothing_left(backend, root, marker)


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="as root the box's init joins the memory group")
async def test_a_close_racing_the_memory_group_join_raises_the_closed_error(
    monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    # The close runs on its own thread, as `close_soon` runs it, while the box's init joins the
    # memory group (before or after the close removes it: the outcome is the same either way).
    opened = open_sandbox(Isolated(limits=ResourceLimits(memory_bytes=128 << 20)))
    sandbox = next(opened)
    backend = sandbox.backend
    assert isinstance(backend, IsolatedBackend)
    if backend.memory_group is None:
        opened.close()
        pytest.skip(f"no memory cgroup here: {backend.memory_bound}")
    group_path = backend.memory_group.path
    root = backend.workspace
    real_spawn: _Spawn = process_module._spawn
    real_remove = local_module.remove_workspace
    closing = threading.Event()
    closer = threading.Thread(target=backend.close)

    def remove_workspace(path: Path) -> None:
        closing.set()  # the sandbox is marked closed and its known commands killed by now
        real_remove(path)

    async def spawn_then_close(*args: object, **kwargs: object) -> anyio.abc.Process:
        process = await real_spawn(*args, **kwargs)
        closer.start()
        await anyio.to_thread.run_sync(closing.wait)
        return process

    monkeypatch.setattr(local_module, "remove_workspace", remove_workspace)
    monkeypatch.setattr(process_module, "_spawn", spawn_then_close)
    try:
        with pytest.raises(SandboxError) as error:
            await sandbox.run_command(_command(marker))
        await anyio.to_thread.run_sync(closer.join)
        _assert_closed_at_start(error)
        await _assert_nothing_left(backend, root, marker)
        assert _removed(group_path)
    finally:
        opened.close()


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="only as root does a box have a uid of its own")
async def test_a_close_removes_the_workspace_only_once_its_killed_boxes_exited(
    monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    # A box killed by the close but not yet gone could still be setting up: bubblewrap looking
    # for the removed workspace wrote its own error as the command's stderr (the attack's
    # "bwrap: Can't get type of source"). So no process of the box may be left at the removal.
    opened = open_sandbox(Isolated())
    sandbox = next(opened)
    backend = sandbox.backend
    assert isinstance(backend, IsolatedBackend)
    real_remove = local_module.remove_workspace
    at_removal: list[list[str]] = []

    def remove_workspace(path: Path) -> None:
        at_removal.append(_processes_of(backend.host_uid))
        real_remove(path)

    monkeypatch.setattr(local_module, "remove_workspace", remove_workspace)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(sandbox.run_command, f"sleep {marker}")
            while not processes_with(marker):  # the box runs the command
                await anyio.sleep(0.01)
            await anyio.to_thread.run_sync(backend.close)
        assert at_removal == [[]]
    finally:
        opened.close()
