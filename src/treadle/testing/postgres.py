"""`PostgresCluster`: a throwaway PostgreSQL server for tests and benchmarks of conversation
stores: `initdb` and `pg_ctl` in a temporary directory, on a free port, its unix socket in that
directory; stopped and deleted by `remove()`.

initdb refuses to run as root, so as root the cluster runs as `nobody` (through `runuser`).
Needs PostgreSQL's server binaries (Debian: the `postgresql` package) and, for `new_database`,
psycopg (the `treadle[postgres]` extra).
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
from pathlib import Path

from treadle.errors import ConfigurationError

__all__ = ["MISSING", "PostgresCluster", "postgres_bin"]

#: What to say when the binaries are not there.
MISSING = "PostgreSQL is not installed (apt-get install postgresql; make install does it)"


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/N/bin), or
    the directory of `initdb` on PATH; None when there is none."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if found and Path(found[-1], "initdb").exists():
        return Path(found[-1])
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PostgresCluster:
    """A running throwaway cluster: `dsn(db)` connects to database `db` over its unix socket.

    `PostgresCluster()` runs `initdb` and starts the server; `remove()` stops it and deletes its
    files. Use it as a context manager in your own tests.
    """

    def __init__(self, bin_dir: Path | None = None) -> None:
        found = bin_dir or postgres_bin()
        if found is None:
            raise ConfigurationError(f"{MISSING}.")
        self.bin = found
        self.dir = Path(tempfile.mkdtemp(prefix="treadle-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: run the cluster as nobody
            shutil.chown(self.dir, "nobody")
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

    def __enter__(self) -> PostgresCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Stop (if running) and delete the cluster."""
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
