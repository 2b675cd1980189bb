"""A store file that goes away under a running process, hostile keys, and odd store URLs.

Real SQLite files deleted, replaced and overwritten on disk while a store has them open; a
throwaway PostgreSQL cluster for the keys (both backends must refuse them the same way).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from treadle import Session, run_session_loop
from treadle.errors import ConfigurationError, StoreError
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor

AGENT = Session.from_agent_prompt("Answer briefly.")


def _remove_database(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def test_a_sqlite_file_deleted_while_open_is_a_store_error_not_a_lost_write(
    tmp_path: Path,
) -> None:
    path = tmp_path / "chat.db"
    with Store.sqlite(path) as store:
        store.append("k", [ChunkRow.user("kept")])
        _remove_database(path)
        with pytest.raises(StoreError, match="was deleted while this process had it open"):
            store.append("k", [ChunkRow.user("lost")])
        with pytest.raises(StoreError, match="was deleted"):  # a pass fails the same way
            run_session_loop(
                Session.from_user_message("hi"),
                AGENT,
                executor=ScriptedExecutor(["hello"]),
                store=store,
                conversation="k",
            ).synchronize()
        with Store.sqlite(path) as fresh:  # opening again uses the file now at the path
            assert fresh.append("k", [ChunkRow.user("new")]) == 1
        assert path.exists()


def test_a_sqlite_file_replaced_while_open_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    other = tmp_path / "other.db"
    with Store.sqlite(other) as elsewhere:
        elsewhere.append("theirs", [ChunkRow.user("x")])
    with Store.sqlite(path) as store:
        store.append("k", [ChunkRow.user("kept")])
        os.replace(other, path)
        with pytest.raises(StoreError, match="was replaced by another file"):
            store.conversation("k").synchronize()
        with pytest.raises(StoreError, match="was replaced"):  # every later call, too
            store.append("k", [ChunkRow.user("lost")])


def test_a_sqlite_file_overwritten_in_place_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    with Store.sqlite(path) as store:
        store.append("k", [ChunkRow.user("kept")])
        with open(path, "r+b") as f:  # same inode, garbage where the header and pages were
            f.write(b"this is not a database" * 4096)
        with pytest.raises(StoreError, match="was overwritten"):
            store.append("k", [ChunkRow.user("more")])


def test_a_sqlite_write_ahead_log_deleted_while_open_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    with Store.sqlite(path) as store:
        store.append("k", [ChunkRow.user("kept")])
        Path(f"{path}-wal").unlink()  # commits would go to a log no other process reads
        with pytest.raises(StoreError, match="write-ahead log"):
            store.append("k", [ChunkRow.user("lost")])


@pytest.mark.parametrize("key", ["a\x00b", "\ud800", "ok\udfff"])
def test_a_key_no_database_can_hold_is_refused_the_same_way_on_both_backends(
    url: str, key: str
) -> None:
    with Store.open(url) as store:
        with pytest.raises(ConfigurationError, match="conversation key"):
            store.append(key, [ChunkRow.user("x")])
        with pytest.raises(ConfigurationError, match="conversation key"):
            store.conversation(key)
        with pytest.raises(ConfigurationError, match="conversation key"):
            run_session_loop(
                Session.from_user_message("hi"),
                AGENT,
                executor=ScriptedExecutor(["hello"]),
                store=store,
                conversation=key,
            ).synchronize()
        assert store.conversations() == []  # nothing was written under any spelling of it


def test_text_no_database_can_hold_is_a_configuration_error_before_anything_runs(
    url: str,
) -> None:
    """A lone surrogate (what JSON's "\\ud800" escape decodes to) in a user message or in
    appended rows: a typed error up front, no pass recorded, the conversation still usable."""
    bad = "bad \ud800 text"
    with Store.open(url) as store:
        with pytest.raises(ConfigurationError, match="user input cannot be stored"):
            run_session_loop(
                Session.from_user_message(bad),
                AGENT,
                executor=ScriptedExecutor(["hello"]),
                store=store,
                conversation="k",
            ).synchronize()
        with pytest.raises(ConfigurationError, match=r"cannot be stored.*nothing was written"):
            store.append("k", [ChunkRow.user(bad)])
        assert store.pending() == [] and store.conversations() == []
        out = run_session_loop(
            Session.from_user_message("fine"),
            AGENT,
            executor=ScriptedExecutor(["hello"]),
            store=store,
            conversation="k",
        ).synchronize()
        assert out.metadata["version"] == 2


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("sqlite:///chat\x00.db", "NUL"),
        ("chat\x00.db", "NUL"),
        ("postgresql://app@127.0.0.1/db\x00x", "NUL"),
        ("sqlite:///chat.db?mode=ro", "no query"),
        ("sqlite:///chat.db#frag", "no query"),
        ("mysql://app@db/app", "names no store"),
        ("redis://localhost", "names no store"),
        ("sqlite://chat.db", "not a SQLite URL"),
    ],
)
def test_an_odd_store_url_is_a_configuration_error_saying_what(
    where: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=says):
        Store.open(where)
    assert list(tmp_path.iterdir()) == []  # no file was made from a half-read location


def test_a_store_path_that_is_not_text_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="bytes"):
        Store.sqlite(b"chat.db")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="str or a path"):
        Store.open(42)  # type: ignore[arg-type]
    assert sqlite3.sqlite_version  # the standard library's SQLite, nothing to install
