"""`mypy` as a user runs it on their own code, with one cache shared by the suite's checks.

A user's strict configuration (MYPY_INI: no exception for `treadle`) in a temporary directory
outside the repository, so mypy sees `treadle` as a user does: through the installed package
and its `py.typed`, with no project config. Runs take turns on one lock: the first type-checks
Treadle and its dependencies into the shared cache, the others read it.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

MYPY_INI = """\
[mypy]
strict = True
warn_unused_ignores = True
"""


def run_user_mypy(shared: Path, directory: Path, *files: str) -> subprocess.CompletedProcess[str]:
    """mypy on `files` (relative to `directory`) with MYPY_INI and the cache in `shared`."""
    (directory / "mypy.ini").write_text(MYPY_INI)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return subprocess.run(
            [
                sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
                "--cache-dir", str(shared / "cache"), *files,
            ],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
