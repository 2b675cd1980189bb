"""A PostgreSQL store's pools under a server that refuses, restarts or is closed under them
(attack att_u): a loop's own pool and the runtime's behave alike.

Real parts: a throwaway PostgreSQL cluster (the shared `pg` one, or one of the test's own where
it is restarted), roles with a connection limit, real forks."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

from pg_cluster import Cluster
from treadle.session import ChunkRow
from treadle.stores import Store, postgres_loops
from treadle.stores.records import RowCache

#: A hang guard (generous, for a loaded machine), never a time assertion.
GUARD = 60.0


@pytest.fixture(params=["own pool", "runtime pool"])
def pools(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every call on a loop's own pool from the first, or every call on the runtime's."""
    after = 0 if request.param == "own pool" else 10**9
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", after)
    monkeypatch.setattr(postgres_loops, "SWEEP_SECONDS", 0.05)
    return str(request.param)


def _limited_database(pg: Cluster, limit: int) -> str:
    """A fresh database owned by a new role that may hold `limit` connections; its DSN."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    role = f"r_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT {limit}")
        conn.execute(f"CREATE DATABASE {name} OWNER {role}")
    return f"postgresql://{role}@/{name}?host={pg.dir}&port={pg.port}"


def test_calls_past_the_servers_connection_limit_wait_for_a_connection(
    pg: Cluster, pools: str
) -> None:
    # The role may hold 2 connections, the pool would open 4: the calls past 2 are refused a
    # connection and must wait for one to come back, not fail.
    store = Store.postgres(_limited_database(pg, 2), pool_size=4)

    async def main() -> list[object]:
        await store.aappend("warm", [ChunkRow.user("hi")])
        return list(
            await asyncio.wait_for(
                asyncio.gather(
                    *(store.aappend(f"k{i}", [ChunkRow.user(f"m{i}")]) for i in range(40)),
                    return_exceptions=True,
                ),
                GUARD,
            )
        )

    try:
        outcomes = asyncio.run(main())
        assert [o for o in outcomes if isinstance(o, BaseException)] == []
        assert outcomes == [1] * 40
    finally:
        store.close()


def test_a_call_that_finds_no_connection_at_all_waits_until_one_can_open(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    url = _limited_database(pg, 2)
    store = Store.postgres(url, pool_size=2)
    # The store's first connection (the schema) on a loop that then ends, closing its pool;
    # a first connection that fails is a fast ConfigurationError, which this is not about.
    asyncio.run(store.aappend("warm", [ChunkRow.user("hi")]))
    blockers = [psycopg.connect(url, autocommit=True) for _ in range(2)]  # the role's two
    done = threading.Event()
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(store.aappend("k", [ChunkRow.user("hi")])))
        except BaseException as err:  # read by the test
            outcome.append(err)
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert not done.wait(0.5)  # refused, and trying again: not failed
        for blocker in blockers:
            blocker.close()
        thread.join(GUARD)
        assert outcome == [1]
    finally:
        for blocker in blockers:
            blocker.close()
        store.close()


def test_connections_the_server_ended_while_idle_are_replaced_not_used(pools: str) -> None:
    from treadle.testing.postgres import PostgresCluster

    cluster = PostgresCluster()  # its own: this test restarts it
    try:
        url = cluster.new_database()
        store = Store.postgres(url, pool_size=4)

        async def warm() -> None:  # every connection of the pool opened and left idle
            await asyncio.gather(*(store.aappend(f"w{i}", [ChunkRow.user("x")]) for i in range(8)))

        async def after_restart() -> list[object]:
            await warm()
            cluster.stop()
            cluster.start()
            found: list[object] = []
            for i in range(10):
                try:
                    found.append(await store.aappend("k", [ChunkRow.user(f"m{i}")]))
                except Exception as err:  # read by the test
                    found.append(type(err).__name__)
            return found

        try:
            assert asyncio.run(after_restart()) == list(range(1, 11))
        finally:
            store.close()
    finally:
        cluster.remove()


def test_closing_the_store_lets_another_loops_running_append_finish(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    url = pg.new_database()
    # A connect slowed past 5 s by a loaded machine would send the append to the runtime's
    # pool (see the refused-connection tests): this test is about the loop's own.
    store = Store.postgres(url, pool_size=2, connect_timeout=60.0)
    store.append("k", [ChunkRow.user("hi")])
    blocker = psycopg.connect(url, autocommit=True)
    blocker.execute("BEGIN")
    blocker.execute("SELECT pg_advisory_xact_lock(hashtextextended('k', 0))")  # k's write lock
    watcher = psycopg.connect(url, autocommit=True)
    outcome: list[object] = []
    appending = threading.Event()

    def lock_waiters() -> int:
        found = watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        ).fetchone()
        return int(found[0]) if found else 0

    async def append() -> None:
        task = asyncio.ensure_future(store.aappend("k", [ChunkRow.user("more")]))
        # The append's write waits on the lock (its read has ended: a close during the read
        # fails the append, nothing written, which this test is not about).
        while not await asyncio.to_thread(lock_waiters):
            await asyncio.sleep(0.01)
        assert [p.connections for p in store.backend._loop_pools.values()] == [1]  # its own
        appending.set()
        try:
            outcome.append(await task)
        except BaseException as err:  # read by the test
            outcome.append(err)

    thread = threading.Thread(target=asyncio.run, args=(append(),))
    thread.start()
    closing = threading.Thread(target=store.close)
    try:
        assert appending.wait(GUARD)
        (pool,) = store.backend._loop_pools.values()
        closing.start()
        while not pool.closed:  # the close has begun on the append's loop
            threading.Event().wait(0.01)
        blocker.execute("ROLLBACK")  # the append, running when the close began, goes on
        thread.join(GUARD)
        closing.join(GUARD)
        assert outcome == [2]  # it landed, and said so (not a StoreError after committing)
        with Store.postgres(url) as check:
            assert [r.payload["content"] for r in check.conversation("k").rows] == ["hi", "more"]
    finally:
        blocker.close()
        watcher.close()
        store.close()


def test_a_forked_child_ending_its_loop_leaves_the_parents_connections_alone(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    url = pg.new_database()
    store = Store.postgres(url, pool_size=1)

    async def main() -> int:
        await store.aappend("k", [ChunkRow.user("hi")])  # the loop's pool holds a connection
        (pool,) = store.backend._loop_pools.values()
        pid = os.fork()
        if pid == 0:  # the child lets go of the pool, as its sweep or its loop's end would
            pool.abandon()  # (asyncio cannot run the parent's loop on in a child)
            os._exit(0)
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        return await store.aappend("k", [ChunkRow.user("after")])  # the same connection

    try:
        assert asyncio.run(main()) == 2
    finally:
        store.close()


def test_a_commit_extends_cached_rows_only_of_the_conversation_it_checked() -> None:
    cache = RowCache()
    again = (ChunkRow.user("new one"),)
    cache.put("k", 2.0, again)  # "k" deleted and started again (created at 2.0), 1 row
    cache.extend("k", 1, [ChunkRow.user("late")], created_at=1.0)  # the old one's commit
    assert cache.get("k", 2.0, 1) == again
    cache.extend("k", 1, [ChunkRow.user("next")], created_at=2.0)
    assert [r.payload["content"] for r in cache.get("k", 2.0, 2)] == ["new one", "next"]


def test_a_loop_refused_its_first_connection_uses_the_runtimes_pool(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The role's two connections: one in the runtime's pool, one in another loop's own pool,
    # both idle. A new loop's own pool is refused its first: the call takes the runtime's pool
    # (whose idle connection is there) instead of waiting for a connection that never frees.
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    store = Store.postgres(_limited_database(pg, 2), pool_size=2)
    store.append("warm", [ChunkRow.user("hi")])  # the runtime's pool and its connection
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        first = asyncio.run_coroutine_threadsafe(
            store.aappend("a", [ChunkRow.user("a")]), other
        ).result(GUARD)  # that loop's own pool keeps its connection, idle
        assert first == 1
        assert asyncio.run(asyncio.wait_for(store.aappend("b", [ChunkRow.user("b")]), GUARD)) == 1
    finally:  # closed on the other loop first: its pool closes there, awaited
        asyncio.run_coroutine_threadsafe(store.aclose(), other).result(GUARD)
        other.call_soon_threadsafe(other.stop)
        thread.join(GUARD)
        other.close()


def test_a_connection_past_descriptor_1023_is_seen_alive(pg: Cluster) -> None:
    import resource

    import psycopg

    from treadle.stores.postgres_open import alive

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"needs 1,200 file descriptors (ulimit -n is {soft})")
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the socket lands past
    try:

        async def check() -> tuple[int, bool]:
            conn = await psycopg.AsyncConnection.connect(pg.dsn(), autocommit=True)
            try:
                return conn.pgconn.socket, alive(conn)
            finally:
                await conn.close()

        socket, up = asyncio.run(check())
        assert socket >= 1024
        assert up
    finally:
        for fd in spare:
            os.close(fd)


def test_a_call_waiting_on_a_connection_the_server_then_ends_tries_again(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loop's pool holds one connection, in use; its second is refused (the role's limit):
    # the next call waits for the first. The server ends that one: the waiting call must try to
    # connect again (and, refused still, take the runtime's pool), not wait for ever.
    import psycopg

    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    url = _limited_database(pg, 2)
    database = url.split("@/", 1)[1].split("?")[0]
    admin = psycopg.connect(pg.dsn(database), autocommit=True)  # a superuser: not limited
    store = Store.postgres(url, pool_size=2)

    def lock_waiter() -> int | None:
        found = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        ).fetchone()
        return int(found[0]) if found else None

    async def main() -> tuple[object, object]:
        await store.aappend("warm", [ChunkRow.user("hi")])  # the pool's one connection
        blocker = await asyncio.to_thread(psycopg.connect, url, autocommit=True)  # the other
        await asyncio.to_thread(admin.execute, "BEGIN")
        await asyncio.to_thread(
            admin.execute, "SELECT pg_advisory_xact_lock(hashtextextended('k', 0))"
        )
        held = asyncio.ensure_future(store.aappend("k", [ChunkRow.user("x")]))  # waits on it
        while (pid := await asyncio.to_thread(lock_waiter)) is None:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(store.aappend("j", [ChunkRow.user("y")]))
        (pool,) = store.backend._loop_pools.values()
        while not pool._waiters:  # refused its own connection: waits for the one in use
            await asyncio.sleep(0.01)
        await asyncio.to_thread(admin.execute, "SELECT pg_terminate_backend(%s)", (pid,))
        await asyncio.to_thread(admin.execute, "ROLLBACK")
        await asyncio.to_thread(blocker.close)  # room again, for whoever tries
        gathered = await asyncio.wait_for(
            asyncio.gather(held, waiting, return_exceptions=True), GUARD
        )
        return gathered[0], gathered[1]

    try:
        lost, waited = asyncio.run(main())
        assert isinstance(lost, Exception)  # its connection was ended under it
        assert waited == 1
    finally:
        admin.close()
        store.close()
