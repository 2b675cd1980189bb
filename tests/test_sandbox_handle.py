"""`SandboxHandle` reference counting and its lifecycle through `Session`."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import anyio
import pytest

from treadle.errors import ConfigurationError, SandboxError
from treadle.sandbox import Sandbox, SandboxHandle
from treadle.session import Session


def test_lazy_open_and_close_at_zero_deletes_temp_dir() -> None:
    handle = SandboxHandle("local")
    assert (handle.refcount, handle.opened, handle.closed, handle.sandbox) == (
        1,
        False,
        False,
        None,
    )
    sandbox = handle.open()
    assert isinstance(sandbox, Sandbox) and handle.open() is sandbox and handle.opened
    workspace = sandbox.workspace
    assert workspace.is_dir()
    assert handle.acquire() is handle and handle.refcount == 2
    handle.release()
    assert workspace.is_dir() and not handle.closed
    handle.release()
    assert handle.closed and handle.refcount == 0 and handle.wait_closed(5)
    assert not workspace.exists()
    with pytest.raises(SandboxError):
        handle.acquire()
    with pytest.raises(SandboxError):
        handle.open()
    handle.release()  # over-release is ignored
    assert handle.refcount == 0


def test_never_opened_handle_closes_without_a_directory() -> None:
    handle = SandboxHandle("local")
    handle.release()
    assert handle.closed and not handle.opened and handle.wait_closed(0)


def test_user_directory_is_never_deleted(tmp_path: Path) -> None:
    handle = SandboxHandle(str(tmp_path))
    assert handle.open().workspace == tmp_path.resolve()
    handle.release()
    assert tmp_path.is_dir()


def test_release_from_many_threads() -> None:
    handle = SandboxHandle("local")
    workspace = handle.open().workspace
    for _ in range(63):
        handle.acquire()
    threads = [threading.Thread(target=handle.release) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert handle.closed and handle.wait_closed(5) and not workspace.exists()


async def test_release_on_event_loop_hands_close_to_a_thread() -> None:
    handle = SandboxHandle("local")
    workspace = handle.open().workspace
    handle.release()  # on the loop thread: must not rmtree here, but must still close
    assert handle.closed
    assert await anyio.to_thread.run_sync(handle.wait_closed, 5)
    assert not await anyio.Path(workspace).exists()


async def test_arelease_awaits_the_close() -> None:
    handle = SandboxHandle("local")
    workspace = handle.open().workspace
    await handle.arelease()
    assert handle.closed and not await anyio.Path(workspace).exists()


def test_session_output_shares_input_and_closes_at_zero() -> None:
    session = Session.from_user_message("hi").to("local")
    handle = session.sandbox_handle
    assert handle is not None and handle.refcount == 1 and not handle.opened
    assert session.placement == "local"
    workspace = session.require_sandbox().workspace
    derived = session.add_user_message("more")
    assert derived.sandbox_handle is handle and handle.refcount == 2
    session.close_sandbox()
    session.close_sandbox()  # idempotent per session
    assert handle.refcount == 1 and workspace.is_dir()
    with pytest.raises(ConfigurationError):
        session.require_sandbox()
    with derived:
        assert derived.require_sandbox().workspace == workspace
    assert handle.closed and handle.wait_closed(5) and not workspace.exists()


def test_garbage_collected_session_releases_its_share() -> None:
    session = Session.from_user_message("hi").to("local")
    handle = session.sandbox_handle
    assert handle is not None
    workspace = session.require_sandbox().workspace
    fork = session.fork()
    assert handle.refcount == 2
    del fork
    gc.collect()
    assert handle.refcount == 1
    del session
    gc.collect()
    assert handle.closed and handle.wait_closed(5) and not workspace.exists()


async def test_async_with_session_releases() -> None:
    async with Session.from_user_message("hi").to("local") as session:
        workspace = session.require_sandbox().workspace
        handle = session.sandbox_handle
        assert handle is not None
    assert handle.closed and not await anyio.Path(workspace).exists()


def test_child_process_sees_temp_dir_gone_at_interpreter_exit(tmp_path: Path) -> None:
    """An unreleased handle's close at interpreter exit (finaliser) still deletes the dir."""
    script = tmp_path / "script.py"
    out = tmp_path / "ws.txt"
    script.write_text(
        "from treadle.session import Session\n"
        "s = Session.from_user_message('x').to('local')\n"
        f"open({str(out)!r}, 'w').write(str(s.require_sandbox().workspace))\n"
    )
    import subprocess
    import sys

    subprocess.run([sys.executable, "-W", "error", str(script)], check=True, timeout=60)
    assert not os.path.exists(out.read_text())
