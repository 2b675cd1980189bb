"""Bad input and lost stores: a DSN that does not connect, a database that goes away mid-pass,
a schema from a newer Treadle, URLs that name no store."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from pg_cluster import Cluster, require_postgres
from treadle import Session, run_session_loop, tool
from treadle.errors import ConfigurationError, StoreError
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

AGENT = Session.from_agent_prompt("Answer briefly.")


def test_a_dsn_that_does_not_connect_is_a_configuration_error_naming_the_cause() -> None:
    store = Store.postgres("postgresql://nobody@127.0.0.1:1/none", connect_timeout=5)
    with pytest.raises(ConfigurationError, match=r"cannot connect .*127\.0\.0\.1.*refused"):
        store.conversation("k").synchronize()
    store.close()


def test_a_dsn_that_does_not_parse_fails_at_the_call() -> None:
    with pytest.raises(ConfigurationError, match="does not parse"):
        Store.postgres("host=x port")


@pytest.mark.parametrize("url", ["redis://x", "sqlite://relative.db"])
def test_a_url_naming_no_store_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        Store.open(url)


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    Store.sqlite(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO treadle_schema VALUES (99)")
    with pytest.raises(ConfigurationError, match="version 99, newer"):
        Store.sqlite(path)


def test_damaged_rows_are_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "d.db"
    with Store.sqlite(path) as store:
        store.append("k", [ChunkRow.user("fine")])
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE rows SET payload = '{not json' WHERE key = 'k'")
        with pytest.raises(StoreError, match="not JSON"):
            store.conversation("k").synchronize()


def test_rows_stored_as_payloads_or_as_wire_messages_read_alike(tmp_path: Path) -> None:
    """A row is stored as its cached wire message (its payload with a `role`); rows an older
    Treadle stored as bare payloads read back the same, and so do this one's in an older reader
    (`ChunkRow` drops a `role` its kind implies, and keeps `developer`)."""
    path = tmp_path / "forms.db"
    rows = [
        ChunkRow.system("be brief"),
        ChunkRow("system", {"role": "developer", "content": "dev"}),
        ChunkRow.user("hi"),
        ChunkRow("assistant", {"content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]}),
        ChunkRow("tool_result", {"tool_call_id": "c1", "content": "ok"}),
    ]  # fmt: skip
    with Store.sqlite(path) as store:
        store.append("new", rows)
    with sqlite3.connect(path) as conn:
        stored = [json.loads(p) for (p,) in conn.execute("SELECT payload FROM rows ORDER BY seq")]
        assert [p.get("role") for p in stored] == [
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ]
        conn.executemany(  # the older form: the payload alone
            "INSERT INTO rows (key, seq, pass_id, kind, payload) VALUES ('old', ?, NULL, ?, ?)",
            [(i, r.kind, json.dumps(r.payload)) for i, r in enumerate(rows)],
        )
        conn.execute(
            "INSERT INTO conversations SELECT 'old', version, usage, stop_reason, metadata,"
            " NULL, NULL, created_at, updated_at FROM conversations WHERE key = 'new'"
        )
    with Store.sqlite(path) as store:
        assert tuple(store.conversation("new").rows) == tuple(rows)
        assert tuple(store.conversation("old").rows) == tuple(rows)
    assert [ChunkRow(r.kind, p) for r, p in zip(rows, stored, strict=True)] == rows


@pytest.mark.slow  # stops and restarts a PostgreSQL cluster, 30 s: `make test-slow`
def test_a_store_lost_mid_pass_fails_the_pass_and_writes_nothing() -> None:
    require_postgres()
    cluster = Cluster()
    try:
        dsn = cluster.new_database()
        started, release = threading.Event(), threading.Event()

        @tool
        def slow() -> str:
            """Wait for the test."""
            started.set()
            release.wait(240)
            return "done"

        with Store.postgres(dsn) as store:
            store.append(
                "kept", [ChunkRow.user("before"), ChunkRow("assistant", {"content": "ok"})]
            )
            out = run_session_loop(
                Session.from_user_message("now"),
                AGENT,
                executor=ScriptedExecutor([tool_call("slow", {}), "never committed"]),
                tools=[slow],
                store=store,
                conversation="kept",
            )
            assert started.wait(240)
            cluster.stop("immediate")  # the database goes away while the tool runs
            release.set()
            with pytest.raises(StoreError, match="PostgreSQL store"):
                out.synchronize()
        cluster.start()
        with Store.postgres(dsn) as again:
            rows = again.conversation("kept").rows
            assert [r.content for r in rows] == ["before", "ok"]  # the last committed version
    finally:
        cluster.remove()


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port=1 password=s3cr3tpw dbname=x user=u",  # libpq keyword form
        "POSTGRESQL://u:s3cr3tpw@127.0.0.1:1/db",  # schemes are case-insensitive
        "Postgres://u:s3cr3tpw@127.0.0.1:1/db",
    ],
)
def test_every_postgresql_dsn_form_reaches_postgresql_and_no_error_repeats_the_password(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a DSN taken for a file name would create it here
    store = Store.open(dsn)
    assert store.url.startswith("postgresql://u@127.0.0.1:1/")
    with pytest.raises(ConfigurationError, match="cannot connect to the PostgreSQL store") as err:
        store.conversation("k").synchronize()
    store.close()
    assert "s3cr3tpw" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "url", ["REDIS://u:s3cr3tpw@x/0", "mysql://u:s3cr3tpw@x/db", "SQLITE://u:s3cr3tpw@x"]
)
def test_a_url_naming_no_store_never_repeats_its_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        Store.open(url)
    assert "s3cr3tpw" not in str(err.value) and "***" in str(err.value)
