"""Treadle's own Python helpers (the exit hand-off of a workspace removal, process-backend
workers, the local model server) never import Treadle from the parent's working directory: that
directory can hold files a box wrote, and the parent can be root (issue 29, review round 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from treadle.runtime.child_python import python_child_argv

_SRC = Path(__file__).resolve().parent.parent / "src"


def _plant(cwd: Path, marker: Path) -> None:
    """A `treadle/` package in `cwd` whose `sandbox.removal` and `distributed.process` only
    write `marker` (what box-written code would do instead)."""
    for package in ("treadle", "treadle/sandbox", "treadle/distributed"):
        (cwd / package).mkdir(parents=True, exist_ok=True)
        (cwd / package / "__init__.py").write_text("")
    body = f"open({str(marker)!r}, 'w').write('planted code ran')\n"
    body += "def _main(argv):\n    return 0\n"
    (cwd / "treadle/sandbox/removal.py").write_text(body)
    (cwd / "treadle/distributed/process.py").write_text(body)


def test_a_child_never_imports_treadle_from_the_working_directory(tmp_path: Path) -> None:
    planted, marker = tmp_path / "planted", tmp_path / "MARKER"
    _plant(planted, marker)
    argv = python_child_argv("treadle.sandbox.removal", "_main", "not-absolute")
    proc = subprocess.run(
        argv,
        cwd=planted,
        env={**os.environ, "PYTHONPATH": str(planted)},  # ignored too (-I)
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert not marker.exists()
    assert proc.returncode == 2  # the real `_main` refused the relative path
    assert "usage: treadle.sandbox.removal._main" in proc.stderr


_HAND_OFF = """
import sys
from pathlib import Path
from treadle.sandbox import removal

root = Path(sys.argv[1])
removal._hand_off(root)
"""


def test_the_exit_hand_off_runs_the_installed_removal_quietly(tmp_path: Path) -> None:
    """The detached removal started from a cwd holding a planted `treadle/` runs Treadle's own
    code (the planted one would leave the marker), and prints no `runpy` warning."""
    planted, marker = tmp_path / "planted", tmp_path / "MARKER"
    _plant(planted, marker)
    root = tmp_path / "workspace"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text("x")
    proc = subprocess.run(  # returns once the detached child closed the inherited stderr too
        [sys.executable, "-P", "-c", _HAND_OFF, str(root)],  # -P: the parent itself is clean
        cwd=planted,
        env={**os.environ, "PYTHONPATH": str(_SRC)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for _ in range(600):  # the child may still be finishing (no time limit asserted)
        if not os.path.lexists(root) or marker.exists():
            break
        time.sleep(0.5)
    assert not marker.exists()
    assert not os.path.lexists(root)
    assert "is finishing the deletion" in proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
