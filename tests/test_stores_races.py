"""Races with the store's own writes. PostgreSQL retention racing commits: a delete or prune
and a pass's commit on one conversation never leave rows without a head, never report a commit
that no one can read, and never delete a conversation changed after the prune looked at it. A
SQLite file pulled away while a write transaction runs fails that write. An owner in another pid
namespace is judged by its lease.

Real parts: a throwaway PostgreSQL cluster (tests/pg_cluster.py) and a second real connection
that holds the other side of each race open (a transaction left uncommitted), so the order is
forced, not left to timing; real SQLite files deleted or replaced on disk.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pg_cluster import Cluster
from treadle.errors import ConflictError, StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores import Store

#: How long the side transaction stays open so the other side is surely waiting on it (a wait
#: that makes the race happen in the bad order, never a limit on how long anything takes).
HOLD_SECONDS = 0.5


def _state(dsn: str, key: str) -> tuple[int, int | None]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT count(*) FROM treadle_rows WHERE key = %s", (key,)).fetchone()
        head = conn.execute(
            "SELECT version FROM treadle_conversations WHERE key = %s", (key,)
        ).fetchone()
    return int(rows[0]) if rows else 0, None if head is None else int(head[0])


async def _commit(store: Store, key: str, base: int, count: int) -> int:
    rows = [ChunkRow.user(f"{key}-{base + i}") for i in range(count)]
    backend: Any = store.backend
    version: int = await backend.commit(
        uuid.uuid4().hex, key, base, rows, usage=Usage(), stop_reason="stop", metadata={},
        agent_rows=[],
    )  # fmt: skip
    return version


def test_a_commit_racing_a_delete_conflicts_and_leaves_no_rows_behind(pg: Cluster) -> None:
    import psycopg

    dsn = pg.new_database()

    async def main() -> None:
        store = Store.postgres(dsn)
        await store.aappend("victim", [ChunkRow.user(f"r{i}") for i in range(5)])
        # A delete that has the conversation's rows locked but has not committed yet (the same
        # statements a delete runs, without any lock a commit would wait on first).
        side = await psycopg.AsyncConnection.connect(dsn)
        for sql in (
            "DELETE FROM treadle_rows WHERE key = %s",
            "DELETE FROM treadle_conversations WHERE key = %s",
        ):
            await side.execute(sql, ("victim",))
        commit = asyncio.ensure_future(_commit(store, "victim", 5, 3))
        await asyncio.sleep(HOLD_SECONDS)
        await side.commit()
        await side.close()
        with pytest.raises(ConflictError):
            await commit
        assert _state(dsn, "victim") == (0, None)
        # The key is usable again from scratch.
        assert await store.aappend("victim", [ChunkRow.user("a"), ChunkRow.user("b")]) == 2
        assert await store.aappend("victim", [ChunkRow.user("c")]) == 3
        assert await _commit(store, "victim", 3, 2) == 5  # and a commit to it moves its head
        assert _state(dsn, "victim") == (5, 5)
        # And the real API racing: either the commit lands first and the delete takes it, or
        # the delete lands first and the commit conflicts; never rows without their head.
        for round_ in range(10):
            key = f"race{round_}"
            await store.aappend(key, [ChunkRow.user("x")] * 5)
            await asyncio.gather(
                _commit(store, key, 5, 3), store.adelete(key), return_exceptions=True
            )
            assert _state(dsn, key) == (0, None)
        await store.aclose()

    asyncio.run(main())


def test_a_key_left_with_rows_but_no_head_works_again(pg: Cluster) -> None:
    import psycopg

    dsn = pg.new_database()

    async def main() -> None:
        store = Store.postgres(dsn)
        await store.aappend("k", [ChunkRow.user("warm up")])  # creates the schema
        with psycopg.connect(dsn, autocommit=True) as conn:  # what an older release could leave
            conn.execute(
                "INSERT INTO treadle_rows (key, seq, pass_id, kind, payload)"
                " VALUES ('orphan', 0, NULL, 'user', '{}')"
            )
        assert await _commit(store, "orphan", 0, 2) == 2
        assert _state(dsn, "orphan") == (2, 2)
        await store.aclose()

    asyncio.run(main())


def test_prune_keeps_a_conversation_committed_to_while_it_ran(pg: Cluster) -> None:
    import psycopg

    dsn = pg.new_database()

    async def main() -> None:
        store = Store.postgres(dsn)
        for key in ("old", "fresh"):
            await store.aappend(key, [ChunkRow.user("x")] * 2)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE treadle_conversations SET updated_at = 0")
        # A commit to "fresh" in flight: it holds the conversation's lock, as treadle_commit
        # does, and has moved its head, but has not committed when the prune looks.
        side = await psycopg.AsyncConnection.connect(dsn)
        await side.execute("SELECT pg_advisory_xact_lock(hashtextextended('fresh', 0))")
        await side.execute(
            "INSERT INTO treadle_rows (key, seq, pass_id, kind, payload)"
            " VALUES ('fresh', 2, NULL, 'user', '{}')"
        )
        await side.execute(
            "UPDATE treadle_conversations SET version = 3, updated_at = %s WHERE key = 'fresh'",
            (time.time(),),
        )
        prune = asyncio.ensure_future(store.aprune(older_than_days=1))
        await asyncio.sleep(HOLD_SECONDS)
        await side.commit()
        await side.close()
        assert await prune == 1
        assert _state(dsn, "old") == (0, None)
        assert _state(dsn, "fresh") == (3, 3)
        await store.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["delete", "replace"])
def test_a_sqlite_file_pulled_away_while_a_write_runs_is_a_store_error(
    tmp_path: Path, how: str
) -> None:
    """The file goes while a write transaction is already past its first check (the job itself
    pulls it away, on the database's own thread): the write is undone, never a success."""
    from treadle.stores.sqlite import _connect
    from treadle.stores.sqlite_thread import release, thread_for

    path = tmp_path / "chat.db"
    spare = tmp_path / "spare.db"
    with Store.sqlite(path) as store:
        store.append("k", [ChunkRow.user("kept")])
    shutil.copy(path, spare)

    def write_then_pull(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO treadle_schema VALUES (42)")
        if how == "delete":
            path.unlink()
        else:
            os.replace(spare, path)
        return 1

    async def main() -> None:
        writer = thread_for(path, _connect)
        try:
            with pytest.raises(StoreError, match="nothing was written"):
                await writer.submit(write_then_pull)
        finally:
            release(writer)

    asyncio.run(main())
    if how == "replace":  # the file now at the path is untouched, and the old one got nothing
        with Store.sqlite(path) as fresh:
            assert [str(r.content) for r in fresh.conversation("k").synchronize().rows] == ["kept"]


def test_an_owner_in_another_pid_namespace_is_judged_by_its_lease_not_by_pid() -> None:
    """Same host name, another pid namespace (containers sharing a UTS namespace): its pid
    means nothing here, so a pid that is dead here does not free its pass, and one alive here
    does not hold it past its lease. Records as a process there writes them (`this_owner`)."""
    from treadle.stores.owner import owner_alive, this_owner

    lease = 4.0

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid with no process behind it here
    mine = this_owner()
    there = {**mine, "pid": gone.pid, "pidns": "another-boot:4026531836", "lease": lease}
    now = time.time()
    assert owner_alive({"owner": there}, now, now)  # fresh lease: the owner may still run it
    assert not owner_alive({"owner": there}, now - lease - 1, now)  # its lease ran out
    alive_here = {**there, "pid": os.getpid()}  # a pid alive here is no proof over there
    assert not owner_alive({"owner": alive_here}, now - lease - 1, now)
    # In this namespace the pid is still what decides (a dead owner frees its pass at once).
    assert not owner_alive({"owner": {**mine, "pid": gone.pid}}, now, now)
    assert owner_alive({"owner": mine}, now - 10 * lease, now)
