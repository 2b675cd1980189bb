"""A PostgreSQL store's pools on the loops that call it (`treadle.stores.postgres_loops`): reads
and commits from two loops of one process agree, a loop's pool closes when the loop ends (no
connection left in `pg_stat_activity`), loops run one after another do not add connections, a
caller without a loop still works, and every caller waiting on a loop's pool gets a
`StoreError` when it dies.

Real parts: a throwaway PostgreSQL cluster (tests/pg_cluster.py), event loops in real threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

from pg_cluster import Cluster
from treadle import Session, arun_session_loop
from treadle.errors import ConflictError, StoreError
from treadle.session import ChunkRow
from treadle.stores import Store, postgres_loops
from treadle.testing import ScriptedExecutor

T = TypeVar("T")

AGENT = Session.from_agent_prompt("Answer briefly.")
#: A hang guard (generous, for a loaded machine), never a time assertion.
GUARD = 60.0


@pytest.fixture
def own_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loop gets its own pool from its first call (not after `OWN_POOL_AFTER` calls), and
    the runtime's loop looks for closed loops often."""
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    monkeypatch.setattr(postgres_loops, "SWEEP_SECONDS", 0.05)


class LoopThread:
    """An event loop running in its own thread; `run(coro)` awaits `coro` there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(GUARD)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(GUARD)
        self.loop.close()


@contextmanager
def loop_thread() -> Iterator[LoopThread]:
    running = LoopThread()
    try:
        yield running
    finally:
        running.stop()


def backends(url: str) -> int:
    """Connections to `url`'s database now, other than the one asking."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(found[0]) if found else 0


def eventually(check: Callable[[], bool]) -> None:
    """Wait until `check()` holds (a closed connection's server process exits a moment after
    the client closed it); `GUARD` bounds the wait as a hang guard."""
    deadline = threading.Event()
    timer = threading.Timer(GUARD, deadline.set)
    timer.start()
    try:
        while not check():
            assert not deadline.is_set(), "the condition never held"
            threading.Event().wait(0.02)
    finally:
        timer.cancel()


def texts(session: Any) -> list[str]:
    return [str(r.payload.get("content")) for r in session.rows]


def test_reads_and_commits_from_two_loops_stay_consistent(pg: Cluster, own_pools: None) -> None:
    store = Store.postgres(pg.new_database())
    try:
        with loop_thread() as a, loop_thread() as b:
            a.run(store.aappend("k", [ChunkRow.user("one")]))
            assert texts(b.run(store.backend.load("k"))) == ["one"]  # cached for b's reads
            # A pass on loop a (the batched read and commit), then b reads: the whole turn.
            a.run(
                arun_session_loop(
                    Session.from_user_message("two"),
                    AGENT,
                    executor=ScriptedExecutor(["two answer"]),
                    store=store,
                    conversation="k",
                )
            )
            assert texts(b.run(store.backend.load("k"))) == ["one", "two", "two answer"]
            # b writes at the version a's pass moved on from: a conflict, nothing written.
            with pytest.raises(ConflictError):
                b.run(store.aappend("k", [ChunkRow.user("stale")], expected_version=1))
            b.run(store.aappend("k", [ChunkRow.user("three")], expected_version=3))
            assert texts(a.run(store.backend.load("k")))[-1] == "three"
            # Deleted and started again on a: b reads the new conversation, not its old rows.
            a.run(store.adelete("k"))
            a.run(store.aappend("k", [ChunkRow.user("fresh")]))
            assert texts(b.run(store.backend.load("k"))) == ["fresh"]
            pools = store.backend._loop_pools
            assert pools[a.loop].connections >= 1 and pools[b.loop].connections >= 1
    finally:
        store.close()


def test_a_loop_ended_by_asyncio_run_closes_its_pool(pg: Cluster, own_pools: None) -> None:
    url = pg.new_database()
    store = Store.postgres(url)

    async def main() -> int:
        await store.aappend("k", [ChunkRow.user("hi")])
        found = await asyncio.gather(*(store.backend.load(f"k{i % 3}") for i in range(40)))
        assert len(found) == 40
        (pool,) = store.backend._loop_pools.values()
        return pool.connections

    try:
        assert asyncio.run(main()) >= 1
        assert not store.backend._loop_pools
        eventually(lambda: backends(url) == 0)  # before: the store's pool stayed open
        assert texts(store.conversation("k")) == ["hi"]  # the sync API: the runtime's pool
    finally:
        store.close()


def test_many_sequential_asyncio_runs_do_not_grow_connections(pg: Cluster) -> None:
    url = pg.new_database()
    store = Store.postgres(url)
    calls = postgres_loops.OWN_POOL_AFTER + 8  # enough for each loop to get its own pool

    async def main(n: int) -> int:
        for i in range(calls):
            await store.backend.load(f"k{i}")
        await store.aappend("k", [ChunkRow.user(f"run {n}")])
        return sum(p.connections for p in store.backend._loop_pools.values())

    try:
        for n in range(12):
            assert asyncio.run(main(n)) >= 1
            # The runtime's pool keeps its one connection (each loop's first calls took it).
            eventually(lambda: backends(url) <= 1)
        assert len(store.conversation("k").rows) == 12
    finally:
        store.close()


def test_a_loop_closed_without_ending_its_tasks_leaves_no_connection(
    pg: Cluster, own_pools: None
) -> None:
    url = pg.new_database()
    store = Store.postgres(url)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(store.aappend("k", [ChunkRow.user("hi")]))
        assert backends(url) >= 1
        loop.close()  # no shutdown of its async generators: the store's sweep finds it
        eventually(lambda: backends(url) == 0 and not store.backend._loop_pools)
    finally:
        store.close()


def test_a_caller_without_a_loop_still_works_beside_loops(pg: Cluster, own_pools: None) -> None:
    store = Store.postgres(pg.new_database())
    try:
        store.append("k", [ChunkRow.user("sync")])
        with loop_thread() as a:
            a.run(store.aappend("k", [ChunkRow.user("loop")]))
            store.append("k", [ChunkRow.user("sync again")])
            assert texts(a.run(store.backend.load("k"))) == ["sync", "loop", "sync again"]
        assert texts(store.conversation("k")) == ["sync", "loop", "sync again"]
        assert [i.key for i in store.conversations()] == ["k"]
    finally:
        store.close()


def test_callers_waiting_on_a_loops_pool_get_a_store_error_when_it_closes(
    pg: Cluster, own_pools: None
) -> None:
    import psycopg

    url = pg.new_database()
    store = Store.postgres(url, pool_size=1)
    store.append("k", [ChunkRow.user("hi")])
    blocker = psycopg.connect(url, autocommit=True)

    def lock_waits() -> int:
        found = blocker.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        ).fetchone()
        return int(found[0]) if found else 0

    async def main() -> list[BaseException | object]:
        await store.backend.load("k")  # the loop's pool has its one connection
        blocker.execute("BEGIN; LOCK TABLE treadle_conversations IN ACCESS EXCLUSIVE MODE")
        reading = asyncio.ensure_future(store.backend.load("k"))  # its batch waits on the lock
        while not await asyncio.to_thread(lock_waits):
            await asyncio.sleep(0.01)
        listing = asyncio.ensure_future(store.apending("k"))  # waits for the one connection
        (pool,) = store.backend._loop_pools.values()
        while not pool._waiters:
            await asyncio.sleep(0.01)
        await store.aclose()
        return list(
            await asyncio.gather(
                asyncio.wait_for(reading, GUARD),
                asyncio.wait_for(listing, GUARD),
                return_exceptions=True,
            )
        )

    try:
        outcomes = asyncio.run(main())
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        store.close()
    assert [type(o) for o in outcomes] == [StoreError, StoreError], outcomes


def test_a_loops_connection_killed_mid_read_is_a_store_error_and_the_next_read_works(
    pg: Cluster, own_pools: None
) -> None:
    import psycopg

    url = pg.new_database()
    store = Store.postgres(url, pool_size=1)
    store.append("k", [ChunkRow.user("hi")])
    blocker = psycopg.connect(url, autocommit=True)

    def kill_the_waiting_read() -> int:
        found = blocker.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        ).fetchall()
        return len(found)

    async def main() -> tuple[BaseException | object, list[str]]:
        await store.backend.load("k")
        blocker.execute("BEGIN; LOCK TABLE treadle_conversations IN ACCESS EXCLUSIVE MODE")
        reading = asyncio.ensure_future(store.backend.load("k"))
        while not await asyncio.to_thread(kill_the_waiting_read):
            await asyncio.sleep(0.01)
        (first,) = await asyncio.gather(asyncio.wait_for(reading, GUARD), return_exceptions=True)
        blocker.execute("ROLLBACK")
        return first, texts(await store.backend.load("k"))  # on a new connection

    try:
        first, after = asyncio.run(main())
    finally:
        blocker.close()
        store.close()
    assert isinstance(first, StoreError), first
    assert after == ["hi"]


def test_queue_mode_passes_on_two_loops_take_turns(pg: Cluster, own_pools: None) -> None:
    """Passes on one conversation from two loops with their own pools, in queue mode: each
    reads what the one before committed (no `ConflictError`), and every turn lands whole."""
    store = Store.postgres(pg.new_database(), on_conflict="queue")

    async def passes(name: str) -> list[int]:
        versions = []
        for turn in range(3):
            out = await arun_session_loop(
                Session.from_user_message(f"{name}{turn}"),
                AGENT,
                executor=ScriptedExecutor([f"{name}{turn} answer"]),
                store=store,
                conversation="k",
            )
            versions.append(int(out.metadata["version"]))
        return versions

    try:
        with loop_thread() as a, loop_thread() as b:
            ran_a = asyncio.run_coroutine_threadsafe(passes("a"), a.loop)
            ran_b = asyncio.run_coroutine_threadsafe(passes("b"), b.loop)
            versions = ran_a.result(GUARD) + ran_b.result(GUARD)
            pools = store.backend._loop_pools
            assert pools[a.loop].connections >= 1 and pools[b.loop].connections >= 1
        assert sorted(versions) == [2, 4, 6, 8, 10, 12]
        rows = texts(store.conversation("k"))
        assert len(rows) == 12
        for i in range(0, 12, 2):  # each turn whole: its message, then its answer
            assert rows[i + 1] == f"{rows[i]} answer"
    finally:
        store.close()
