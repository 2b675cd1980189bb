"""Bad arguments and hostile store files say what is wrong: `fork(version=)` takes only an int of
0 or more (checked before any I/O), a `treadle_schema` table that holds text is a
`ConfigurationError` naming it (both backends), and a SQLite path that cannot hold a database
(`/dev/null`) reports its own error, not the failed rollback after it. A key holding an empty
conversation exists: an import into it is a `ConflictError`, as a fork onto it is.

Real parts: SQLite files, a throwaway PostgreSQL database (the `url` fixture, `pg`).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from pg_cluster import Cluster
from treadle.errors import ConfigurationError, ConflictError
from treadle.session import ChunkRow
from treadle.stores import Store


@pytest.mark.parametrize("version", [1.5, 2.0, True, "1", -1, -0.5])
def test_fork_takes_only_an_int_version_of_zero_or_more(url: str, version: Any) -> None:
    with Store.open(url) as store:
        store.append("t", [ChunkRow.user("a"), ChunkRow("assistant", {"content": "b"})])
        with pytest.raises(ConfigurationError, match="version"):
            store.fork("t", "f", version=version)
        assert [c.key for c in store.conversations()] == ["t"]  # nothing was made
        assert store.fork("t", "f", version=1).metadata["version"] == 1


def test_fork_checks_its_version_before_any_io(tmp_path: Path) -> None:
    """A closed store would fail any I/O with a `StoreError`: the argument is refused first."""
    store = Store.sqlite(tmp_path / "s.db")
    store.close()
    with pytest.raises(ConfigurationError, match="version"):
        store.fork("t", "f", version=1.5)  # type: ignore[arg-type]


def test_a_sqlite_schema_table_holding_text_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE treadle_schema (version TEXT)")
        conn.execute("INSERT INTO treadle_schema VALUES ('zzz')")
    with pytest.raises(ConfigurationError, match=r"treadle_schema.*'zzz'"):
        Store.sqlite(path)


def test_a_postgres_schema_table_holding_text_is_a_configuration_error(pg: Cluster) -> None:
    import psycopg

    dsn = pg.new_database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE treadle_schema (version TEXT)")
        conn.execute("INSERT INTO treadle_schema VALUES ('zz')")
    with (
        Store.postgres(dsn) as store,
        pytest.raises(ConfigurationError, match=r"treadle_schema.*'zz'"),
    ):
        store.append("k", [ChunkRow.user("x")])


def test_a_sqlite_path_that_holds_no_database_reports_its_own_error() -> None:
    with pytest.raises(ConfigurationError) as caught:
        Store.sqlite("/dev/null")
    assert "rollback" not in str(caught.value)
    assert "/dev/null" in str(caught.value)


def test_an_import_into_an_existing_empty_conversation_is_refused(url: str, tmp_path: Path) -> None:
    """`import_jsonl` writes to a new key only: a key holding an empty conversation exists
    (as `fork` counts it)."""
    source = tmp_path / "e.jsonl"
    with Store.open(url) as store:
        store.append("src", [ChunkRow.user("hello")])
        store.export_jsonl("src", source)
        assert store.append("e", []) == 0
        with pytest.raises(ConflictError, match="already exists"):
            store.import_jsonl(source, key="e")
        assert store.conversation("e").rows == ()


@pytest.mark.parametrize("version", [None, 0])
def test_a_fork_of_a_key_that_does_not_exist_is_refused(url: str, version: int | None) -> None:
    """No branch naming a conversation that is not there: a `ConfigurationError` naming the
    key, as a version out of range is, and nothing is made. An empty conversation exists and
    forks (at version 0)."""
    with Store.open(url) as store:
        with pytest.raises(ConfigurationError, match="'nowhere' does not exist"):
            store.fork("nowhere", "f", version=version)
        assert store.conversations() == []
        store.append("empty", [])
        assert store.fork("empty", "f", version=version).rows == ()
        assert sorted(c.key for c in store.conversations()) == ["empty", "f"]
