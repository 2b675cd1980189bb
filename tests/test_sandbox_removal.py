"""Workspace removal: many files unlinked in batches from one checked directory fd (never
through a link), stoppable between entries, and handed to a detached process at exit so a
workspace is never left half-deleted silently. docs/sandbox.md ("Placements and lifetime",
the escape table) names these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from treadle.errors import SandboxError
from treadle.sandbox import box_tree
from treadle.sandbox.box_tree import RemovalStopped, remove_tree

_SRC = Path(__file__).resolve().parent.parent / "src"


def _tree(root: Path, files: int, dirs: int = 3) -> None:
    for d in range(dirs):
        sub = root / f"d{d}" / "inner"
        sub.mkdir(parents=True)
        for i in range(files):
            (sub / f"f{i}").write_bytes(b"x")


def _run_script(script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter that imports this tree's Treadle; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(_SRC)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _assert_gone_soon(root: Path) -> None:
    """`root` is gone once the detached process finished (waits for it; no time asserted)."""
    for _ in range(600):
        if not os.path.lexists(root):
            break
        time.sleep(0.5)
    assert not os.path.lexists(root)


def test_many_files_go_in_batches_and_no_link_is_followed() -> None:
    outside = Path(tempfile.mkdtemp(prefix="treadle-outside-"))
    (outside / "keep.txt").write_text("host file")
    (outside / "sub").mkdir()
    (outside / "sub" / "also.txt").write_text("host file")
    root = Path(tempfile.mkdtemp(prefix="treadle-rm-"))
    try:
        _tree(root, files=300)  # past the batch threshold: the parallel unlinks run
        for i in range(100):  # links mixed into a big batch, to a file and a directory outside
            os.symlink(outside / "keep.txt", root / "d0" / "inner" / f"link{i}")
            os.symlink(outside / "sub", root / "d1" / "inner" / f"dirlink{i}")
        os.link(outside / "keep.txt", root / "d2" / "hard")  # a hard link to a host file
        remove_tree(root)
        assert not os.path.lexists(root)
        assert (outside / "keep.txt").read_text() == "host file"
        assert (outside / "sub" / "also.txt").read_text() == "host file"
        assert os.stat(outside / "keep.txt").st_nlink == 1
    finally:
        subprocess.run(["rm", "-rf", str(root), str(outside)], check=True)


def test_a_stopped_removal_says_so_and_a_second_call_finishes_it() -> None:
    root = Path(tempfile.mkdtemp(prefix="treadle-rm-"))
    _tree(root, files=200)
    stop = threading.Event()
    stop.set()
    with pytest.raises(RemovalStopped, match="partly removed") as caught:
        remove_tree(root, stop)
    assert isinstance(caught.value, SandboxError)
    assert root.exists()  # stopped before the end: nothing claims it is gone
    remove_tree(root)
    assert not os.path.lexists(root)


_HANDED_OFF = """
import os, sys
from pathlib import Path
from treadle.sandbox import removal
from treadle.sandbox.local import LocalBackend

backend = LocalBackend()
root = backend.open()
for d in range(4):
    sub = root / f"d{d}"
    sub.mkdir()
    for i in range(500):
        (sub / f"f{i}").write_bytes(b"x")
os.chmod(root / "d3", 0)
removal.stop_removals()  # what interpreter exit does once EXIT_WAIT_SECONDS passed
backend.close()  # stops at once and hands the tree to a detached process
print(root)
"""


def test_a_removal_stopped_at_exit_is_finished_by_a_detached_process() -> None:
    proc = _run_script(_HANDED_OFF)
    root = Path(proc.stdout.strip())
    assert f"is finishing the deletion of the workspace {root}" in proc.stderr
    _assert_gone_soon(root)


_EXITING = """
import sys
import anyio
from treadle.sandbox import SandboxHandle, removal

removal.EXIT_WAIT_SECONDS = 0.0  # exit at once: the close thread is handed off if still running
handle = SandboxHandle("local")
box = handle.open()
for d in range(6):
    sub = box.workspace / f"d{d}"
    sub.mkdir()
    for i in range(400):
        (sub / f"f{i}").write_bytes(b"x")

async def release() -> None:
    handle.release()  # on the loop's thread: the close runs on a thread of its own

anyio.run(release)
print(box.workspace)
"""


def test_exit_never_leaves_a_workspace_half_deleted_silently() -> None:
    proc = _run_script(_EXITING)
    root = Path(proc.stdout.strip())
    if os.path.lexists(root):  # still there at exit: a detached process said it is finishing
        assert f"is finishing the deletion of the workspace {root}" in proc.stderr
    _assert_gone_soon(root)


_AT_EXIT = """
import atexit, sys, tempfile
from pathlib import Path
from treadle.sandbox.box_tree import remove_tree

root = Path(tempfile.mkdtemp(prefix="treadle-rm-"))
for i in range(300):  # past the batch threshold: the parallel path is asked for
    (root / f"f{i}").write_bytes(b"x")

def remove() -> None:  # atexit runs after concurrent.futures refuses new work
    remove_tree(root)
    print(root, root.exists())

atexit.register(remove)
"""


def test_removal_at_interpreter_exit_falls_back_to_one_unlink_at_a_time() -> None:
    proc = _run_script(_AT_EXIT)
    assert proc.stdout.strip().endswith(" False"), proc.stdout + proc.stderr


def test_a_directory_moved_out_mid_walk_stops_the_walk_and_the_removal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A box command can rename a directory out of the tree while the host walks it: climbing
    back up must notice (`..` is no longer the directory the walk came down from) and stop,
    never act on the tree the directory now sits in. The move is made at a chosen point."""
    base = Path(tempfile.mkdtemp(prefix="treadle-moved-"))
    root, outside = base / "root", base / "outside"
    try:
        (root / "a" / "b" / "c").mkdir(parents=True)
        (root / "a" / "b" / "c" / "f").write_text("box")
        outside.mkdir()
        (outside / "keep").write_text("host")
        real_clear = box_tree._Unlinker.clear

        def clear_then_move(self: box_tree._Unlinker, fd: int) -> list[str]:
            names = real_clear(self, fd)
            if os.readlink(f"/proc/self/fd/{fd}").endswith("/a/b/c"):
                os.rename(root / "a" / "b", outside / "b")  # c's parent leaves the tree
            return names

        monkeypatch.setattr(box_tree._Unlinker, "clear", clear_then_move)
        with pytest.raises(SandboxError, match="moved while Treadle removed it"):
            remove_tree(root)
        assert (outside / "keep").read_text() == "host"
        assert sorted(os.listdir(outside)) == ["b", "keep"]  # the moved directory was not removed
        monkeypatch.undo()

        subprocess.run(["rm", "-rf", str(root)], check=True)
        (root / "x" / "y").mkdir(parents=True)
        real_open = box_tree._open_dir

        def open_then_move(parent_fd: int, name: str, *, fix_modes: bool) -> int:
            fd = real_open(parent_fd, name, fix_modes=fix_modes)
            if name == "y":
                os.rename(root / "x", outside / "x2")
            return fd

        monkeypatch.setattr(box_tree, "_open_dir", open_then_move)
        with pytest.raises(SandboxError, match="moved while Treadle walked it"):
            box_tree.give_tree_to(root, os.getuid())
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)
