"""The SQLite thread when SQLite undoes a whole transaction itself (disk full, I/O error) in the
middle of a batch, and when the thread itself dies.

Real parts: a SQLite file and its database thread. Disk full is real SQLITE_FULL, made without
root by `PRAGMA max_page_count` on the thread's connection (SQLite then rolls the whole
transaction back, as on a full disk: `conn.in_transaction` is False after it). The batch is
formed for real: a first job holds the thread while the others queue behind it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from treadle.errors import ConflictError, StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores.sqlite import SqliteBackend
from treadle.stores.sqlite_thread import DatabaseThread

#: A deadlock guard, never a timing assertion.
GUARD_SECONDS = 60.0


def _commit(backend: SqliteBackend, key: str, base: int, text: str) -> Awaitable[int]:
    reply = ChunkRow.from_message({"role": "assistant", "content": text})
    return backend.commit(
        f"p-{key}-{base}", key, base, [reply], usage=Usage(), stop_reason="stop",
        metadata={}, agent_rows=(), recorded=False,
    )  # fmt: skip


async def _batch(writer: DatabaseThread, make: Callable[[], list[Awaitable[Any]]]) -> list[Any]:
    """Run the awaitables `make` submits as one batch of the thread; their outcomes."""
    hold, held = threading.Event(), threading.Event()

    def blocker(conn: sqlite3.Connection) -> None:
        held.set()
        hold.wait(GUARD_SECONDS)

    first = writer.submit(blocker, read_only=True)
    while not held.is_set():
        await asyncio.sleep(0.001)
    tasks = [asyncio.ensure_future(a) for a in make()]
    await asyncio.sleep(0.05)  # the tasks run to their submit (nothing can run yet)
    hold.set()
    await first
    return await asyncio.wait_for(
        asyncio.gather(*tasks, return_exceptions=True), GUARD_SECONDS
    )  # a hang guard


def _limit_pages(conn: sqlite3.Connection, more: int) -> None:
    """Disk full `more` pages past the file's size, for this connection."""
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    conn.execute(f"PRAGMA max_page_count = {pages + more}")


def _on_disk(path: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    conn = sqlite3.connect(path)
    try:
        heads = conn.execute("SELECT key, version FROM conversations ORDER BY key").fetchall()
        rows = conn.execute("SELECT key, seq FROM rows ORDER BY key, seq").fetchall()
        return heads, rows
    finally:
        conn.close()


def test_max_page_count_rolls_the_transaction_back_like_a_full_disk(tmp_path: Path) -> None:
    """The premise of these tests: SQLITE_FULL from `max_page_count` ends the transaction."""
    conn = sqlite3.connect(tmp_path / "p.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE t (x TEXT)")
    _limit_pages(conn, 3)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO t VALUES ('small')")
    with pytest.raises(sqlite3.OperationalError, match="full"):
        conn.execute("INSERT INTO t VALUES (?)", ("x" * 200_000,))
    assert not conn.in_transaction
    conn.close()


def test_a_commit_that_hits_disk_full_fails_alone_with_a_store_error(tmp_path: Path) -> None:
    """A batch: commits of a, b (too big for the disk), c. b fails with a `StoreError` saying
    the disk is full; a and c land once at the version they asked for; nothing of b is on
    disk; the thread lives on (the next turns commit, a read answers)."""

    async def main() -> tuple[list[Any], list[Any], list[int]]:
        backend = SqliteBackend(tmp_path / "t.db")
        writer = backend._writer
        assert writer is not None
        try:
            for key in "abc":
                await backend.append(key, [ChunkRow.user(f"start {key}")], None)
                await backend.load(key)
            await writer.submit(lambda conn: _limit_pages(conn, 40))
            outcomes = await _batch(
                writer,
                lambda: [
                    _commit(backend, "a", 1, "reply a"),
                    _commit(backend, "b", 1, "B" * 3_000_000),
                    _commit(backend, "c", 1, "reply c"),
                ],
            )
            turns = [_commit(backend, "a", 2, "n"), _commit(backend, "b", 1, "n")]
            turns.append(_commit(backend, "c", 2, "n"))
            after = await asyncio.wait_for(asyncio.gather(*turns), GUARD_SECONDS)
            versions = [(await backend.load(k)).version for k in "abc"]
            return outcomes, after, versions
        finally:
            await backend.aclose()

    outcomes, after, versions = asyncio.run(main())
    assert outcomes[0] == 2 and outcomes[2] == 2, outcomes
    assert isinstance(outcomes[1], StoreError), outcomes
    assert "full" in str(outcomes[1]), outcomes[1]
    assert after == [3, 2, 3]
    assert versions == [3, 2, 3]
    heads, rows = _on_disk(tmp_path / "t.db")
    assert heads == [("a", 3), ("b", 2), ("c", 3)]
    assert rows == [(k, s) for k in "abc" for s in range(3 if k != "b" else 2)]


def test_a_transient_disk_full_never_autocommits_a_later_job(tmp_path: Path) -> None:
    """Disk full for a moment: a job fills the disk once, and space comes back right after (it
    raises the limit as it fails). Nothing after it in the batch may have run outside the
    transaction: c is told its version (never `ConflictError`) and has its turn once."""

    async def main() -> tuple[list[Any], list[str]]:
        backend = SqliteBackend(tmp_path / "t.db")
        writer = backend._writer
        assert writer is not None
        try:
            for key in "ac":
                await backend.append(key, [ChunkRow.user(f"start {key}")], None)
                await backend.load(key)
            await writer.submit(lambda conn: conn.execute("CREATE TABLE side (x TEXT)"))
            await writer.submit(lambda conn: _limit_pages(conn, 40))
            calls = []

            def fills(conn: sqlite3.Connection) -> str:
                calls.append(1)
                try:
                    conn.execute("INSERT INTO side VALUES (?)", ("x" * 3_000_000,))
                except sqlite3.OperationalError:
                    _limit_pages(conn, 10_000)  # space comes back (a log rotated elsewhere)
                    raise
                return "filled"

            outcomes = await _batch(
                writer,
                lambda: [
                    _commit(backend, "a", 1, "reply a"),
                    writer.submit(fills),
                    _commit(backend, "c", 1, "reply c"),
                ],
            )
            rows = [str(r.payload.get("content")) for r in (await backend.load("c")).rows]
            return outcomes, rows
        finally:
            await backend.aclose()

    outcomes, rows = asyncio.run(main())
    assert not any(isinstance(o, ConflictError) for o in outcomes), outcomes
    assert outcomes[0] == 2 and outcomes[2] == 2, outcomes
    assert outcomes[1] == "filled" or isinstance(outcomes[1], StoreError), outcomes
    assert rows == ["start c", "reply c"]
    heads, _ = _on_disk(tmp_path / "t.db")
    assert heads == [("a", 2), ("c", 2)]


def test_a_database_thread_that_dies_fails_every_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread's loop raises (a bug, whatever it is): the batch it held, the jobs queued
    behind it and every later call fail with a `StoreError`; none waits forever."""

    async def main() -> tuple[list[Any], BaseException | None]:
        backend = SqliteBackend(tmp_path / "t.db")
        writer = backend._writer
        assert writer is not None
        await backend.append("a", [ChunkRow.user("start a")], None)
        real = DatabaseThread._run_batch

        def broken(self: DatabaseThread, conn: sqlite3.Connection, batch: list[Any]) -> None:
            if any(job[0] is boom for job in batch):
                raise RuntimeError("the thread's loop broke")
            real(self, conn, batch)

        def boom(conn: sqlite3.Connection) -> None:
            return None

        monkeypatch.setattr(DatabaseThread, "_run_batch", broken)
        outcomes = await _batch(
            writer, lambda: [writer.submit(boom), _commit(backend, "a", 1, "reply a")]
        )
        later: BaseException | None = None
        try:
            await asyncio.wait_for(backend.load("a"), GUARD_SECONDS)
        except StoreError as err:
            later = err
        await asyncio.wait_for(backend.aclose(), GUARD_SECONDS)
        return outcomes, later

    outcomes, later = asyncio.run(main())
    assert all(isinstance(o, StoreError) for o in outcomes), outcomes
    assert "the thread's loop broke" in str(outcomes[0])
    assert isinstance(later, StoreError)
