"""Deleting a closed workspace without holding the process's exit for long.

A close deletes its temporary workspace with `treadle.sandbox.box_tree.remove_tree`, which can
take seconds for a tree of 100,000 files (each unlink of a file with data waits for the disk).
Closes on an event loop's thread run on a separate thread (`treadle.sandbox.opening`), and at
interpreter exit those get `EXIT_WAIT_SECONDS` in all. A removal still running then is stopped
between two entries and handed to a detached process (`python -I -c` calling this module's
`_main`, see `treadle.runtime.child_python`: it never imports from the working directory or
`PYTHONPATH`; its own session so the terminal's Ctrl-C does not reach it; working directory
`/` and a minimal environment), which finishes it; a line on
stderr says which directory and which process. So a workspace is never left half-deleted
silently: either it is gone, a process is finishing it (and says on stderr if it cannot), or
the close raised `SandboxError` naming it. This module never deletes anything but the trees
it was given.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from treadle.errors import SandboxError
from treadle.runtime.child_python import python_child_argv
from treadle.sandbox.box_tree import RemovalStopped, remove_tree

__all__ = ["EXIT_WAIT_SECONDS", "remove_workspace", "stop_removals"]

#: Seconds interpreter exit waits in all for workspace removals before handing them off.
EXIT_WAIT_SECONDS = 2.0

#: The environment the detached removal keeps: locale for its messages, nothing that steers Python.
_KEPT_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "PATH")

_running: dict[Path, threading.Event] = {}
_lock = threading.Lock()
_exiting = threading.Event()  # set by `stop_removals`: later removals hand off at once


def remove_workspace(root: Path) -> None:
    """Delete the workspace `root` (see `remove_tree`); once `stop_removals` ran, hand the rest
    to a detached process. `SandboxError` when something cannot be deleted or handed off."""
    stop = threading.Event()
    with _lock:
        _running[root] = stop
        if _exiting.is_set():
            stop.set()
    try:
        remove_tree(root, stop)
    except RemovalStopped:
        _hand_off(root)
    finally:
        with _lock:
            _running.pop(root, None)


def stop_removals() -> int:
    """Ask every running removal (and every later one) to stop and hand its tree off to a
    detached process; return how many were running."""
    with _lock:
        _exiting.set()
        events = list(_running.values())
    for event in events:
        event.set()
    return len(events)


def _hand_off(root: Path) -> None:
    # Isolated (`-I`, cwd "/", a minimal environment): the exiting process's working directory
    # may hold files a box wrote, and this child often runs as root.
    env = {name: os.environ[name] for name in _KEPT_ENV if name in os.environ}
    try:
        process = subprocess.Popen(
            python_child_argv("treadle.sandbox.removal", "_main", str(root)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd="/",
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as e:
        raise SandboxError(
            f"the workspace {root} is only partly deleted (Treadle was exiting, and a process to "
            f"finish it could not start: {e.strerror}); delete it by hand."
        ) from None
    sys.stderr.write(
        f"treadle: process {process.pid} is finishing the deletion of the workspace {root} "
        "(Treadle exited first).\n"
    )


def _main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isabs(argv[0]):
        sys.stderr.write("usage: treadle.sandbox.removal._main /absolute/workspace\n")
        return 2
    try:
        remove_tree(Path(argv[0]))
    except SandboxError as e:
        sys.stderr.write(f"treadle: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
