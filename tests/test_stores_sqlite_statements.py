"""What a turn's commit costs the SQLite database thread, in statements' cursors: a commit of a
conversation whose head the thread knows (every turn after the first) runs its rows' insert and
its head's move on the connection's kept cursor, not on a cursor made, registered and freed for
each statement (`Connection.execute`). What it writes is what another connection reads.

Real parts: a SQLite file, the store's own connection (`_connect`) and commit job.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from treadle.session import ChunkRow, Usage
from treadle.stores.records import RowCache
from treadle.stores.sqlite import _connect
from treadle.stores.sqlite_heads import HeadCache
from treadle.stores.sqlite_writes import StoreConnection, commit_job


class Recording:
    """The kept cursor, recording the statements run on it."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.cursor = cursor
        self.ran: list[tuple[str, int]] = []

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self.ran.append((sql.split()[0], 1))
        return self.cursor.execute(sql, params)

    def executemany(self, sql: str, params: Any) -> sqlite3.Cursor:
        rows = list(params)
        self.ran.append((sql.split()[0], len(rows)))
        return self.cursor.executemany(sql, rows)


def test_a_known_heads_commit_runs_on_the_kept_cursor_and_lands_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    conn = _connect(path)
    assert isinstance(conn, StoreConnection)
    cache, heads = RowCache(), HeadCache()
    try:
        conn.execute("BEGIN IMMEDIATE")
        first = commit_job(
            cache, heads, "p1", "k", 0, [ChunkRow.user("hello")], Usage(1, 1, 2, 1), "stop",
            {}, (), False,
        )  # fmt: skip
        assert first(conn) == 1  # a new conversation: the thread now knows its head
        conn.kept = recording = Recording(conn.kept)  # type: ignore[assignment]
        reply = ChunkRow.from_message({"role": "assistant", "content": "hi"})
        second = commit_job(
            cache, heads, "p2", "k", 1, [ChunkRow.user("again"), reply], Usage(3, 2, 5, 2),
            "stop", {}, (), False,
        )  # fmt: skip
        assert second(conn) == 3
        # The rows' insert and the head's move, each on the kept cursor (no cursor of its own).
        assert recording.ran == [("INSERT", 2), ("UPDATE", 1)]
        conn.execute("COMMIT")
    finally:
        conn.close()
    other = sqlite3.connect(path)
    try:
        rows = other.execute("SELECT seq, pass_id, kind FROM rows ORDER BY seq").fetchall()
        head = other.execute("SELECT version, usage FROM conversations").fetchall()
    finally:
        other.close()
    assert rows == [(0, "p1", "user"), (1, "p2", "user"), (2, "p2", "assistant")]
    assert [version for version, _ in head] == [3]
    assert '"total_tokens":5' in head[0][1].replace(" ", "")
