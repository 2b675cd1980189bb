"""Queue mode (`on_conflict="queue"`) and the event loops its passes run on, on both backends: a
conversation's lock is given back whatever happens to the loop that took it. A loop run with
`run_until_complete` and closed without cancelling its tasks (worker threads and older
frameworks do that) never runs the pass's own release again, so the store gives the lock back:
at the commit's end where the commit completes, or, for a lock whose loop closed before any
commit, on its own.

Real parts: a SQLite file and its lock files, a throwaway PostgreSQL cluster, another client
holding the database's write lock (a SQLite connection in a transaction, a PostgreSQL session).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from treadle import Session, arun_session_loop, run_session_loop
from treadle import tool as make_tool
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.postgres import PostgresCluster
from treadle.testing.scripted import tool_call

#: Tasks of loops these tests close on purpose, kept for the session: collected mid-suite,
#: a coroutine would run its `finally` blocks inside another test (GeneratorExit, asyncio's
#: destroyed-task log).
KEEP: list[asyncio.Task[Any]] = []
AGENT = Session.from_agent_prompt("Answer briefly.")
#: A hang guard (generous, for a loaded machine), never a time assertion.
GUARD = 120
#: Passes left on closed loops, kept for the session: collected, their coroutines would be
#: closed with nothing to run their cleanup on (an unraisable error in a later test).
_LEFT: list[asyncio.Future[Session]] = []


@contextmanager
def write_lock_held(url: str) -> Iterator[Callable[[], None]]:
    """Another client holds the conversation `k`'s write lock until the yielded function is
    called: a commit on `k` waits for it (SQLite: the file's write lock; PostgreSQL: the
    transaction lock every commit on `k` takes)."""
    if url.startswith("sqlite:///"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")

        def free() -> None:
            if conn.in_transaction:
                conn.execute("COMMIT")
    else:
        import psycopg

        conn = psycopg.connect(url, autocommit=True)  # type: ignore[assignment]
        conn.execute("SELECT pg_advisory_lock(hashtextextended('k', 0))")

        def free() -> None:
            conn.execute("SELECT pg_advisory_unlock_all()")

    try:
        yield free
    finally:
        free()
        conn.close()


def _later_pass(store: Store, text: str) -> Session:
    async def main() -> Session:
        return await asyncio.wait_for(
            arun_session_loop(
                Session.from_user_message(text),
                AGENT,
                executor=ScriptedExecutor([f"{text} answer"]),
                store=store,
                conversation="k",
            ),
            GUARD,
        )

    return asyncio.run(main())


def test_a_commit_in_flight_on_a_closed_loop_gives_the_lock_back(url: str) -> None:
    """The pass is cancelled as its commit starts, the commit waits on another client's write
    lock, and the loop is closed: the commit lands once that lock is free, and the
    conversation's lock comes back with it (a later pass on the key finishes)."""
    store = Store.open(url, on_conflict="queue")
    store.append("k", [])  # the schema and the key exist before the other client locks
    real = store.backend.commit
    target: dict[str, asyncio.Future[Any]] = {}
    entered = threading.Event()

    async def commit(*args: Any, **kwargs: Any) -> Any:
        target.pop("pass").cancel()  # the caller gives up as its commit starts
        entered.set()
        return await real(*args, **kwargs)

    store.backend.commit = commit  # type: ignore[method-assign]

    async def first() -> None:
        task = asyncio.ensure_future(
            arun_session_loop(
                Session.from_user_message("first"),
                AGENT,
                executor=ScriptedExecutor(["first answer"]),
                store=store,
                conversation="k",
            )
        )
        target["pass"] = task
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        with write_lock_held(url):
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(first())
            finally:
                KEEP.extend(asyncio.all_tasks(loop))  # see KEEP
                loop.close()  # its tasks (the commit's) are never run again
            assert entered.is_set()
        store.backend.commit = real  # type: ignore[method-assign]
        after = _later_pass(store, "later")
        assert after.metadata["version"] == 4  # the turn landed, then the lock came back
        contents = [str(r.payload.get("content")) for r in store.conversation("k").rows]
        assert contents == ["first", "first answer", "later", "later answer"]
    finally:
        store.close(grace=GUARD)


@pytest.mark.parametrize("where", ["waiting", "holding"])
def test_a_lock_of_a_closed_loop_is_given_back(url: str, where: str) -> None:
    """A loop closed while its pass waits for the conversation's lock (the lock may be granted
    after the loop closed) or while its pass holds it mid-tool: the lock does not stay taken."""
    store = Store.open(url, on_conflict="queue")
    started, release = threading.Event(), threading.Event()

    @make_tool
    def slow() -> str:
        """Wait for the test."""
        started.set()
        release.wait(GUARD)
        return "done"

    @make_tool
    async def forever() -> str:
        """Never ends (its loop is closed under it)."""
        started.set()
        await asyncio.sleep(3600)
        return "never"

    try:
        holder = None
        if where == "waiting":
            holder = run_session_loop(
                Session.from_user_message("hold"),
                AGENT,
                executor=ScriptedExecutor([tool_call("slow", {}), "held"]),
                tools=[slow],
                store=store,
                conversation="k",
            )
            assert started.wait(GUARD)

        async def closed() -> None:
            task = asyncio.ensure_future(
                arun_session_loop(
                    Session.from_user_message("left"),
                    AGENT,
                    executor=ScriptedExecutor([tool_call("forever", {}), "never"]),
                    tools=[forever],
                    store=store,
                    conversation="k",
                )
            )
            _LEFT.append(task)  # never awaited: its loop is closed under it
            if where == "waiting":
                await asyncio.sleep(0.3)  # waiting for its turn by now (either way: no lock)
            else:
                while not started.is_set():
                    await asyncio.sleep(0.01)

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(closed())
        finally:
            KEEP.extend(asyncio.all_tasks(loop))  # see KEEP
            loop.close()  # the pass on it never runs again
        release.set()
        if holder is not None:
            assert holder.synchronize(GUARD).metadata["version"] == 4
        after = _later_pass(store, "later")
        assert after.metadata["version"] == (6 if where == "waiting" else 2)
    finally:
        release.set()
        store.close(grace=GUARD)


def _lock_files_open() -> int:
    """How many of this process's file descriptors are conversation lock files."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += ".locks" in os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_passes_cancelled_as_they_open_the_lock_file_leak_no_descriptor(tmp_path: Path) -> None:
    """A SQLite lock file is opened on a worker thread: a pass cancelled meanwhile closes it
    when the open ends (else each such pass kept a descriptor, and under a low `ulimit -n`
    every later pass failed to open its lock file)."""
    url = str(tmp_path / "s.db")

    async def main() -> int:
        async with Store.open(url, on_conflict="queue") as store:
            for i in range(140):
                task = asyncio.ensure_future(
                    arun_session_loop(
                        Session.from_user_message(f"m{i}"),
                        AGENT,
                        executor=ScriptedExecutor(["x"]),
                        store=store,
                        conversation=f"k{i % 7}",
                    )
                )
                for _ in range(i % 7):  # cancelled at each early step in turn
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await store.asettled()
            await asyncio.sleep(0.3)  # the worker threads' opens have ended
            return _lock_files_open()

    assert asyncio.run(main()) == 0


def _terminate_lock_holders(dsn: str) -> int:
    """End (as an administrator, an idle-session timeout or a failover would) every server
    session holding a conversation lock of the database; how many."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as admin:
        pids = admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
        for (pid,) in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    return len(pids)


@pytest.mark.parametrize("first_ends", ["last", "first"])
def test_a_pass_that_lost_its_postgres_lock_fails_with_a_store_error(
    pg: PostgresCluster, first_ends: str
) -> None:
    """The server ends the connection holding a running pass's conversation lock: another pass
    then takes the lock and runs. The first pass must not commit from what it read (it fails
    with `StoreError` saying it lost the lock, listed by `pending()` as any failed pass is until
    the conversation moves on), and neither pass meets a `ConflictError`, whichever ends
    first."""
    from treadle.errors import StoreError

    dsn = pg.new_database()
    store = Store.open(dsn, on_conflict="queue")
    gates = {"first": threading.Event(), "second": threading.Event()}
    running = {"first": threading.Event(), "second": threading.Event()}

    @make_tool
    def work(who: str) -> str:
        """Wait for the test."""
        running[who].set()
        gates[who].wait(GUARD)
        return f"{who} worked"

    def start(who: str) -> Session:
        return run_session_loop(
            Session.from_user_message(who),
            AGENT,
            executor=ScriptedExecutor([tool_call("work", {"who": who}), f"{who} answer"]),
            tools=[work],
            store=store,
            conversation="k",
        )

    try:
        store.append("k", [])
        first = start("first")
        assert running["first"].wait(GUARD)
        assert _terminate_lock_holders(dsn) == 1
        second = start("second")
        assert running["second"].wait(GUARD)  # it has the lock: the first's is gone
        order = ["second", "first"] if first_ends == "last" else ["first", "second"]
        for who in order:
            gates[who].set()
            with contextlib.suppress(Exception):  # ended: its outcome is checked below
                (first if who == "first" else second).synchronize(GUARD)
            if order == ["first", "second"] and who == "first":  # kept, as a failed pass is
                assert "failed" in [p.status for p in store.pending("k")]
        with pytest.raises(StoreError, match="lost the lock"):
            first.synchronize(GUARD)
        assert second.synchronize(GUARD).metadata["version"] == 4
        contents = [str(r.payload.get("content")) for r in store.conversation("k").rows]
        assert contents[0] == "second" and "first" not in contents
        assert store.pending("k") == []  # the conversation moved on past the failed pass
    finally:
        for gate in gates.values():
            gate.set()
        store.close(grace=GUARD)
