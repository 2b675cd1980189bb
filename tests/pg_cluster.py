"""The throwaway PostgreSQL cluster of the store tests (`treadle.testing.PostgresCluster`), as a
fixture body: without PostgreSQL's binaries the tests that need it skip naming the package, and
fail when the CI environment variable is set (CI installs `postgresql`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from treadle.testing.postgres import MISSING, PostgresCluster, postgres_bin

Cluster = PostgresCluster


def require_postgres() -> None:
    """Nothing, or a skip (a failure on CI) when PostgreSQL is not installed."""
    if postgres_bin() is None:
        if os.environ.get("CI"):
            pytest.fail(f"{MISSING}; CI must install it.")
        pytest.skip(MISSING)


def cluster() -> Iterator[PostgresCluster]:
    """A cluster for the duration of the caller (a fixture body)."""
    require_postgres()
    running = PostgresCluster()
    try:
        yield running
    finally:
        running.remove()


def latin1_database(pg: PostgresCluster) -> str:
    """The DSN of a new LATIN1 database in `pg` (keys and rows it cannot hold fail there)."""
    import psycopg

    name = f"latin1_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(
            f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0"
        )
    return pg.dsn(name)
