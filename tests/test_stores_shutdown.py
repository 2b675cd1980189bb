"""A store's home loop stopping mid-batch: every caller waiting on another loop gets a typed
`StoreError`, never a hang; and one commit whose parameters PostgreSQL cannot take fails alone.

Real parts: event loops in real threads, a throwaway PostgreSQL cluster (tests/pg_cluster.py).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pg_cluster import Cluster
from treadle.errors import StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores import Store
from treadle.stores.batching import Batcher
from treadle.stores.hop import LoopHop

#: A deadlock guard, never a timing assertion: a caller left waiting fails the test.
GUARD_SECONDS = 30.0


@pytest.fixture
def home() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop running in its own thread (as the runtime's does)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(GUARD_SECONDS)
    if not loop.is_closed():
        loop.close()


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    loop.call_soon_threadsafe(loop.stop)
    while loop.is_running():
        threading.Event().wait(0.01)
    loop.close()


async def _never(_: list[int]) -> list[int]:
    await asyncio.Event().wait()
    return []


def test_a_batch_destroyed_with_its_stopped_loop_fails_its_callers(
    home: asyncio.AbstractEventLoop,
) -> None:
    async def main() -> None:
        batcher: Batcher[int, int] = Batcher(_never, home=home, concurrency=1)
        waiting = asyncio.ensure_future(batcher(1))
        queued = asyncio.ensure_future(batcher(2))
        while not batcher._tasks:  # the batch runs on the home loop
            await asyncio.sleep(0.01)
        (task,) = batcher._tasks
        _stop(home)  # the batch is still pending
        # What the garbage collector does to a pending task of a closed loop: close its
        # coroutine, on a thread where no loop runs.
        closer = threading.Thread(target=task.get_coro().close)
        closer.start()
        closer.join(GUARD_SECONDS)
        for call in (waiting, queued):
            with pytest.raises(StoreError):
                await asyncio.wait_for(call, GUARD_SECONDS)

    asyncio.run(main())


def test_a_runtime_stopping_mid_batch_fails_callers_on_other_loops(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from treadle.runtime import shutdown
    from treadle.stores import postgres_loops

    # The caller's loop reaches the runtime's pool by the hop (it never gets its own pool).
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 1 << 30)

    url = pg.new_database()
    store = Store.postgres(url)
    store.append("k", [ChunkRow.user("hi")])
    outcomes: list[BaseException | object] = []
    blocker = psycopg.connect(url, autocommit=True)
    try:
        # The batch's read waits on a table lock, so it is in flight when the runtime stops.
        blocker.execute("BEGIN; LOCK TABLE treadle_conversations IN ACCESS EXCLUSIVE MODE")

        def caller() -> None:
            async def main() -> None:
                try:
                    outcomes.append(await asyncio.wait_for(store.backend.load("k"), GUARD_SECONDS))
                except BaseException as err:  # the test looks at it
                    outcomes.append(err)

            asyncio.run(main())

        thread = threading.Thread(target=caller)
        thread.start()
        while not blocker.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        ).fetchone()[0]:  # type: ignore[index]
            threading.Event().wait(0.01)
        shutdown(0.5)
        thread.join(GUARD_SECONDS * 2)
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()
        store.close()
    (outcome,) = outcomes
    assert isinstance(outcome, StoreError), repr(outcome)


def test_closing_a_batcher_fails_running_queued_and_later_callers(
    home: asyncio.AbstractEventLoop,
) -> None:
    async def main() -> None:
        batcher: Batcher[int, int] = Batcher(_never, home=home, concurrency=1)
        calls = [asyncio.ensure_future(batcher(i)) for i in range(3)]
        while not batcher._tasks:
            await asyncio.sleep(0.01)
        asyncio.run_coroutine_threadsafe(batcher.close(), home).result(GUARD_SECONDS)
        for call in calls:
            with pytest.raises(StoreError):
                await asyncio.wait_for(call, GUARD_SECONDS)
        with pytest.raises(StoreError):
            await batcher(9)

    asyncio.run(main())


def test_a_batcher_closed_with_the_store_tells_queued_and_running_callers_apart(
    home: asyncio.AbstractEventLoop,
) -> None:
    # A store's close (not its loop stopping): a queued or later request was never sent
    # (nothing of it written), a running batch's request was cut off mid-way (outcome as the
    # close says): each caller hears which, never "the store's event loop has stopped".
    async def main() -> None:
        batcher: Batcher[int, int] = Batcher(_never, home=home, concurrency=1)
        running = asyncio.ensure_future(batcher(0))
        while not batcher._tasks:
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(batcher(1))
        while not batcher._queue:
            await asyncio.sleep(0.01)
        closing = batcher.close(StoreError("not sent"), running=StoreError("cut off"))
        asyncio.run_coroutine_threadsafe(closing, home).result(GUARD_SECONDS)
        with pytest.raises(StoreError, match="cut off"):
            await asyncio.wait_for(running, GUARD_SECONDS)
        with pytest.raises(StoreError, match="not sent"):
            await asyncio.wait_for(queued, GUARD_SECONDS)
        with pytest.raises(StoreError, match="not sent"):
            await batcher(9)

    asyncio.run(main())


def test_closing_a_loop_hop_fails_running_and_later_operations(
    home: asyncio.AbstractEventLoop,
) -> None:
    async def main() -> None:
        hop = LoopHop(home)
        calls = [asyncio.ensure_future(hop.run(lambda: asyncio.Event().wait())) for _ in range(3)]
        while len(hop._running) < 3:
            await asyncio.sleep(0.01)
        asyncio.run_coroutine_threadsafe(hop.close(), home).result(GUARD_SECONDS)
        for call in calls:
            with pytest.raises(StoreError):
                await asyncio.wait_for(call, GUARD_SECONDS)
        with pytest.raises(StoreError):
            await hop.run(lambda: asyncio.sleep(0))

    asyncio.run(main())


def test_a_commit_postgres_cannot_take_fails_alone_with_a_store_error(pg: Cluster) -> None:
    store = Store.postgres(pg.new_database())
    backend = store.backend
    cases = {"ok1": "stop", "bad": "s\udc00", "ok2": "stop"}
    keys = {name: uuid.uuid4().hex for name in cases}

    async def main() -> list[int | BaseException]:
        return await asyncio.gather(
            *(
                backend.commit(
                    keys[name],
                    name,
                    0,
                    [ChunkRow.user("x")],
                    usage=Usage(),
                    stop_reason=stop,
                    metadata={},
                    agent_rows=[],
                )
                for name, stop in cases.items()
            ),
            return_exceptions=True,
        )

    try:
        ok1, bad, ok2 = asyncio.run(main())
        assert ok1 == 1 and ok2 == 1, (ok1, ok2)
        assert isinstance(bad, StoreError), repr(bad)
        assert "bad" in str(bad)
        assert sorted(c.key for c in store.conversations()) == ["ok1", "ok2"]
    finally:
        store.close()


def test_a_sqlite_close_waits_at_most_grace_for_a_commit_stuck_on_another_clients_lock(
    tmp_path: Path,
) -> None:
    """Another client holds the file's write lock; a cancelled pass's commit waits for it (up
    to the 60 s busy timeout) on the database thread. `aclose(grace=...)` gives up on it after
    `grace` and leaves the thread (a daemon) to the database: it used to join the thread for
    up to 30 s more, while the promise is "at most `grace`". The other client keeps its lock
    until `aclose` has returned, so a close that waited for the commit would be the hang."""
    import sqlite3

    from treadle import Session, arun_session_loop
    from treadle.testing import ScriptedExecutor

    path = tmp_path / "s.db"
    closed = threading.Event()

    async def main() -> None:
        store = Store.open(str(path))
        await store.aappend("k", [])
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            task = asyncio.ensure_future(
                arun_session_loop(
                    Session.from_user_message("u"),
                    Session.from_agent_prompt("A."),
                    executor=ScriptedExecutor(["x"]),
                    store=store,
                    conversation="k",
                )
            )
            await asyncio.sleep(0.3)  # its commit waits for the other client's lock by now
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The guard only catches the hang (the old close took 30 s more); it asserts no time.
            await asyncio.wait_for(store.aclose(grace=0.2), 15)
            closed.set()
        finally:
            other.execute("ROLLBACK")
            other.close()

    asyncio.run(main())
    assert closed.is_set()
