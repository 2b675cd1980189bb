"""The SQLite thread's batches: jobs that queue up together share one transaction, and a job
that fails undoes only its own writes, whatever ran before and after it in the batch.

Real parts: a SQLite file and its database thread. The batch is formed for real: a first job
holds the thread (on a `threading.Event`) while the others queue behind it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

from store_commits import cancel_a_commit_in_flight
from treadle.session import ChunkRow, Usage
from treadle.stores.sqlite import SqliteBackend

#: A deadlock guard, never a timing assertion.
GUARD_SECONDS = 60.0


def test_a_write_that_fails_in_a_batch_undoes_only_its_own_statements(tmp_path: Path) -> None:
    """A batch: commits of two conversations, a job that writes then raises, a third commit.
    The failing job's write is gone and its error is its own; every commit lands once, at the
    version it asked for (no `ConflictError` from a head the failed attempt had moved), and the
    next turns continue from them."""

    async def main() -> tuple[list[Any], list[int], list[int], int]:
        backend = SqliteBackend(tmp_path / "t.db")
        writer = backend._writer
        assert writer is not None
        try:
            for key in ("a", "b", "c"):
                await backend.append(key, [ChunkRow.user(f"start {key}")], None)
                await backend.load(key)  # heads known to the thread
            await writer.submit(lambda conn: conn.execute("CREATE TABLE side (x INTEGER)"))
            hold, held = threading.Event(), threading.Event()

            def blocker(conn: sqlite3.Connection) -> None:
                held.set()
                hold.wait(GUARD_SECONDS)

            def fails(conn: sqlite3.Connection) -> None:
                conn.execute("INSERT INTO side VALUES (1)")
                raise ValueError("this job fails after its write")

            def commit(key: str) -> Any:
                reply = ChunkRow.from_message({"role": "assistant", "content": f"reply {key}"})
                return backend.commit(
                    f"p-{key}", key, 1, [reply], usage=Usage(), stop_reason="stop",
                    metadata={}, agent_rows=(), recorded=False,
                )  # fmt: skip

            first = writer.submit(blocker)
            while not held.is_set():
                await asyncio.sleep(0.001)
            tasks = [
                asyncio.ensure_future(commit("a")),
                asyncio.ensure_future(commit("b")),
                asyncio.ensure_future(writer.submit(fails)),
                asyncio.ensure_future(commit("c")),
            ]
            await asyncio.sleep(0.05)  # the tasks run to their submit (nothing can run yet)
            hold.set()
            await first
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            versions = [(await backend.load(k)).version for k in ("a", "b", "c")]
            again = []
            for k in ("a", "b", "c"):
                again.append(
                    await backend.commit(
                        f"q-{k}",
                        k,
                        2,
                        [ChunkRow.user("next")],
                        usage=Usage(),
                        stop_reason="stop",
                        metadata={},
                        agent_rows=(),
                        recorded=False,
                    )
                )
            side = await writer.submit(
                lambda conn: int(conn.execute("SELECT count(*) FROM side").fetchone()[0])
            )
            return outcomes, versions, again, side
        finally:
            await backend.aclose()

    outcomes, versions, again, side = asyncio.run(main())
    assert outcomes[:2] == [2, 2] and outcomes[3] == 2, outcomes
    assert isinstance(outcomes[2], ValueError), outcomes
    assert versions == [2, 2, 2]
    assert again == [3, 3, 3]
    assert side == 0  # the failed job's insert was undone, alone


def test_a_sqlite_commit_runs_without_a_task_and_is_waited_for(tmp_path: Path) -> None:
    """On SQLite a pass's commit is a job of the database thread settled by one call on the
    pass's loop: no commit task is made. A pass cancelled while that commit is in flight
    still has it waited for by `asettled`, and the turn lands whole."""
    first, rows, in_flight, pending = cancel_a_commit_in_flight(str(tmp_path / "s.db"))
    assert "_commit" not in first, first
    assert in_flight == 1
    assert rows[:2] == ["A", "answer A"]
    assert rows[2:] in ([], ["B", "answer B"])  # whole turn or none
    assert pending == ([] if rows[2:] else ["cancelled"])


def test_reads_take_no_write_lock_and_see_what_another_process_committed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A batch of reads runs in a read transaction: while another process holds the file's
    write lock (its transaction not yet committed) a read is served from the last committed
    state, and once that process commits, the next read sees its rows (its `PRAGMA
    data_version` moved: the heads this thread knew are read again). A read that took the write
    lock would wait for the other writer and fail with "database is locked" (the busy timeout
    is made short here)."""
    from treadle.stores import sqlite as sqlite_store

    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_MS", 200)
    path = tmp_path / "t.db"

    async def main() -> tuple[int, int, list[str]]:
        backend = SqliteBackend(path)
        try:
            await backend.append("a", [ChunkRow.user("one")], None)
            await backend.load("a")  # the head is known to the thread
            other = sqlite3.connect(path, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")
                other.execute(
                    "INSERT INTO rows (key, seq, pass_id, kind, payload) VALUES"
                    ' (\'a\', 1, NULL, \'user\', \'{"role":"user","content":"two"}\')'
                )
                other.execute("UPDATE conversations SET version = 2 WHERE key = 'a'")
                during = await asyncio.wait_for(backend.load("a"), GUARD_SECONDS)
                other.execute("COMMIT")
            finally:
                if other.in_transaction:
                    other.execute("ROLLBACK")
                other.close()
            after = await backend.load("a")
            return during.version, after.version, [r.payload["content"] for r in after.rows]
        finally:
            await backend.aclose()

    during, after, contents = asyncio.run(main())
    assert during == 1
    assert after == 2
    assert contents == ["one", "two"]


def test_a_read_sqlite_fails_is_a_store_error(tmp_path: Path) -> None:
    """A read is a future of the caller's loop (no coroutine of its own): an error SQLite
    raises in it still reaches the caller as the `StoreError` every other call raises."""
    from treadle.errors import StoreError

    path = tmp_path / "t.db"

    async def main() -> str:
        backend = SqliteBackend(path)
        try:
            await backend.append("a", [ChunkRow.user("one")], None)
            other = sqlite3.connect(path, isolation_level=None)
            other.execute("DROP TABLE rows")  # as a damaged or foreign file would be
            other.close()
            try:
                await backend.load("a")
            except StoreError as err:
                return str(err)
            return "no error"
        finally:
            await backend.aclose()

    said = asyncio.run(main())
    assert "failed: no such table: rows" in said


def test_each_commit_leaves_its_own_stop_reason_and_kept_metadata_in_the_file(
    tmp_path: Path,
) -> None:
    """A commit that keeps the head's stop reason and metadata writes only what moved (its
    version, usage, time); one that changes them writes them: a fresh backend (no cache) reads
    each commit's own, however the ones before it ended."""
    path = tmp_path / "heads.db"
    ends: list[tuple[str | None, dict[str, str]]] = [
        ("stop", {}),
        ("stop", {}),  # the same as the head's
        ("length", {"interrupt_reason": "why"}),
        ("length", {"interrupt_reason": "why"}),  # the same again
        ("stop", {}),  # back
    ]

    async def main() -> list[tuple[str | None, dict[str, Any], int, int]]:
        seen = []
        for i, (stop, meta) in enumerate(ends):
            backend = SqliteBackend(path)
            try:
                await backend.load("k")  # the head cached, as a pass's read leaves it
                await backend.commit(
                    f"p{i}", "k", 2 * i, [ChunkRow.user(f"u{i}")],
                    usage=Usage(1, 1, 2, 2 * i + 1),
                    stop_reason=stop, metadata=meta, agent_rows=(), recorded=False,
                )  # fmt: skip
                # Again, with the head cached from the commit before: the second commit of
                # each backend takes the head it moved in place.
                await backend.commit(
                    f"q{i}", "k", 2 * i + 1, [ChunkRow.user(f"v{i}")],
                    usage=Usage(1, 1, 2, 2 * i + 2),
                    stop_reason=stop, metadata=meta, agent_rows=(), recorded=False,
                )  # fmt: skip
            finally:
                await backend.aclose()
            fresh = SqliteBackend(path)
            try:
                got = await fresh.load("k")
                seen.append((got.stop_reason, dict(got.metadata), got.version, got.usage.requests))
            finally:
                await fresh.aclose()
            # The next backend's commits start from this version.
            ends_at = got.version
            assert ends_at == 2 * (i + 1)
        return seen

    seen = asyncio.run(main())
    assert [(s, m) for s, m, _, _ in seen] == ends
    assert [v for _, _, v, _ in seen] == [2, 4, 6, 8, 10]
    assert [r for _, _, _, r in seen] == [2, 4, 6, 8, 10]  # each backend's last commit's usage
