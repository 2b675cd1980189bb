"""A throwaway PostgreSQL cluster for the store tests: `initdb` + `pg_ctl` in a temporary
directory, on a free port, its unix socket in the same directory; stopped and removed after.

initdb refuses to run as root, so as root the cluster runs as `nobody` (with `runuser`). Without
PostgreSQL's binaries the tests that need it skip naming the package, and fail when the CI
environment variable is set (CI installs `postgresql`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/<N>/bin).
_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
PG_BIN: Path | None = Path(_BINS[-1]) if _BINS and Path(_BINS[-1], "initdb").exists() else None
MISSING = "PostgreSQL is not installed (apt-get install postgresql; make install does it)"


def require_postgres() -> Path:
    """The bin directory, or a skip (a failure on CI)."""
    if PG_BIN is None:
        if os.environ.get("CI"):
            pytest.fail(f"{MISSING}; CI must install it.")
        pytest.skip(MISSING)
    return PG_BIN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    """One running cluster: `dsn(db)` connects to database `db` over its unix socket."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="treadle-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: run the cluster as nobody
            shutil.chown(self.dir, "nobody", "nogroup")
            self._as = ["runuser", "-u", "nobody", "--"]
        os.chmod(self.dir, 0o755)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8", "--locale=C")  # fmt: skip
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._as, str(self.bin / tool), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )

    def start(self) -> None:
        """Start the server (waits until it accepts connections)."""
        options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"),
                  "-w", "-t", "120", "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`immediate`: as if it crashed)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop")

    def dsn(self, db: str = "postgres") -> str:
        """A DSN for database `db` over the unix socket."""
        return f"postgresql://postgres@/{db}?host={self.dir}&port={self.port}"

    def new_database(self) -> str:
        """A fresh, empty database; its DSN."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def remove(self) -> None:
        """Stop (if running) and delete the cluster."""
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


def cluster() -> Iterator[Cluster]:
    """A cluster for the duration of the caller (a fixture body)."""
    running = Cluster(require_postgres())
    try:
        yield running
    finally:
        running.remove()
