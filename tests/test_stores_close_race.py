"""Closing a store while another loop's `append` is in flight (a race seen once under load: the
append got "the store's event loop has stopped" from a close). Each case holds the append at a
known point (a lock another connection holds, which the server reports waited on; or a proxy
holding the server's answer to the append's COMMIT), closes the store, lets go and compares what
the append said with what the database holds: a write that landed is reported landed, one
reported failed is not there (unless the server never answered: then the error says so).

Real parts: a throwaway PostgreSQL cluster (tests/pg_cluster.py), a TCP proxy in front of it,
real SQLite files, event loops in real threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from pg_cluster import Cluster
from treadle.errors import StoreError, WriteOutcomeUnknown
from treadle.session import ChunkRow, Usage
from treadle.stores import Store, postgres_loops

#: A hang guard (generous, for a loaded machine), never a time assertion.
GUARD = 60.0

#: Hold an append's write: the conversation's write lock (see `PostgresBackend._lock`).
HOLD_WRITE = "SELECT pg_advisory_xact_lock(hashtextextended('k', 0))"
#: Hold an append's first read (the conversation it checks its rows against).
HOLD_READ = "LOCK TABLE treadle_conversations IN ACCESS EXCLUSIVE MODE"


class Held:
    """A store with conversation "k" (one row), and another client holding `hold` on it; an
    append of "more" from a loop of its own thread waits on that lock."""

    def __init__(self, pg: Cluster, hold: str) -> None:
        import psycopg

        self.url = pg.new_database()
        # connect_timeout 60: a connect slowed by a loaded machine must not change the path
        # (a refused first connection sends a loop's calls to the runtime's pool).
        self.store = Store.postgres(self.url, pool_size=2, connect_timeout=60.0)
        self.store.append("k", [ChunkRow.user("hi")])
        self.admin = psycopg.connect(self.url, autocommit=True)
        self.blocker = psycopg.connect(self.url, autocommit=True)
        self.blocker.execute("BEGIN")
        self.blocker.execute(hold)
        self.outcome: list[object] = []
        self.thread = threading.Thread(target=asyncio.run, args=(self._append(),))
        self.thread.start()
        while not self._lock_waiters():  # the append waits on the lock: held where we want it
            threading.Event().wait(0.01)

    async def _append(self) -> None:
        try:
            self.outcome.append(await self.store.aappend("k", [ChunkRow.user("more")]))
        except BaseException as err:  # read by the test
            self.outcome.append(err)

    def _lock_waiters(self) -> int:
        found = self.admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()"
        ).fetchone()
        return int(found[0]) if found else 0

    def rows(self) -> list[str]:
        """The conversation's rows as the database holds them now."""
        found = self.admin.execute(
            "SELECT payload FROM treadle_rows WHERE key = 'k' ORDER BY seq"
        ).fetchall()
        return [str(json.loads(payload)["content"]) for (payload,) in found]

    def release(self) -> None:
        self.blocker.execute("ROLLBACK")

    def end(self) -> None:
        self.blocker.close()
        self.thread.join(GUARD)
        self.store.close()
        self.admin.close()


def test_an_append_still_reading_when_its_loops_pool_closes_fails_as_closed(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race seen once: the close began while the append was still reading the conversation
    # on its loop's own pool. A read fails at once (nothing of the append was written), but
    # with what happened, the store closed, not "the store's event loop has stopped": that
    # loop was running, and the message sends the reader after a loop that never stopped.
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    held = Held(pg, HOLD_READ)
    try:
        assert [p.connections for p in held.store.backend._loop_pools.values()] == [1]
        held.store.close(grace=GUARD)
        held.release()
        held.thread.join(GUARD)
        (outcome,) = held.outcome
        assert isinstance(outcome, StoreError), outcome
        assert "event loop has stopped" not in str(outcome)
        assert "closed" in str(outcome)
        assert held.rows() == ["hi"]
    finally:
        held.end()


def _closing_thread(held: Held) -> tuple[threading.Thread, list[list[str]]]:
    """A thread (not started) that closes the store with the whole guard as grace, and the list
    where it puts what the database holds as its close returns."""
    seen: list[list[str]] = []

    def close() -> None:
        held.store.close(grace=GUARD)
        seen.append(held.rows())

    return threading.Thread(target=close), seen


def test_closing_waits_within_grace_for_a_write_running_on_the_runtimes_pool(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The append reaches the runtime's pool by the hop (a loop's first calls do, and every call
    # of a loop refused a pool of its own). Running when the close begins, it ends as it would
    # within the grace, as on a loop's own pool: the close returns after it has landed, and
    # the append says so.
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 10**9)
    held = Held(pg, HOLD_WRITE)
    closing, seen = _closing_thread(held)
    try:
        pools = held.store.backend._loop_pools.values()
        assert not any(p.connections for p in pools)  # the runtime's pool, by the hop
        closing.start()
        # The close has returned (before the fix: without waiting for the write) or waits for
        # the write it let run (`_closing_writes`).
        while closing.is_alive() and not getattr(held.store.backend, "_closing_writes", None):
            threading.Event().wait(0.01)
        held.release()
        closing.join(GUARD)
        held.thread.join(GUARD)
        assert seen == [["hi", "more"]]  # landed before the close returned
        assert held.outcome == [2]  # and said so
    finally:
        held.end()


@pytest.mark.parametrize("pools", ["runtime pool", "own pool"])
def test_a_write_still_running_past_the_grace_fails_typed_and_never_lands_later(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch, pools: str
) -> None:
    # Past the grace the close cancels what still runs: the append, stuck on the lock, fails
    # with a typed error and nothing of it is written, then or after the close has returned.
    # On the runtime's pool it went on before the fix and landed once the lock was let go; a
    # loop's own pool did this already (the runtime's now matches it).
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 10**9 if pools == "runtime pool" else 0)
    held = Held(pg, HOLD_WRITE)
    try:
        held.store.close(grace=0.0)
        held.thread.join(GUARD)  # ended by the close, the lock still held
        held.release()
        (outcome,) = held.outcome
        assert isinstance(outcome, StoreError), outcome
        assert "event loop has stopped" not in str(outcome)
        assert held.rows() == ["hi"]
    finally:
        held.end()


def test_a_sqlite_job_handed_to_a_database_thread_that_has_stopped_fails_not_hangs(
    tmp_path: Path,
) -> None:
    # A call that read the store's database thread just before a close stopped it (the close on
    # another thread) hands its job over after the thread's last one: it must fail with a
    # typed error, not wait for ever for a thread that has gone.
    store = Store.sqlite(tmp_path / "s.db")
    store.append("k", [ChunkRow.user("hi")])
    writer = store.backend._writer
    assert writer is not None
    store.close()  # stops the thread: the close came between that call's read and its hand-over

    async def late() -> object:
        return await asyncio.wait_for(writer.submit(lambda conn: 1), GUARD)

    with pytest.raises(StoreError):
        asyncio.run(late())


#: The server's answer to a COMMIT (a CommandComplete message tagged "COMMIT").
_COMMIT_DONE = b"C\x00\x00\x00\x0bCOMMIT\x00"


class CommitHoldingProxy:
    """A TCP proxy in front of the cluster's socket that, once `armed`, holds the server's
    answer to a COMMIT (the server has committed; the client has not heard) until a client
    opens a new connection (a cancel request: the close asking the server to cancel what
    still runs), then lets it through."""

    def __init__(self, socket_path: str, *, release_on_cancel: bool = True) -> None:
        self._path = socket_path
        self._release_on_cancel = release_on_cancel
        self.answer = _COMMIT_DONE  # the answer held (a COMMIT's, by default)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.armed = threading.Event()
        self.holding = threading.Event()
        self.released = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                if self.holding.is_set() and self._release_on_cancel:  # the cancel request
                    self.released.set()
                server = socket.socket(socket.AF_UNIX)
                server.connect(self._path)
                self._sockets += [client, server]
                threading.Thread(
                    target=self._pipe, args=(client, server, False), daemon=True
                ).start()
                threading.Thread(
                    target=self._pipe, args=(server, client, True), daemon=True
                ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        tail = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if answers and self.armed.is_set() and self.answer in tail + data:
                    self.armed.clear()
                    self.holding.set()
                    self.released.wait(GUARD)
                dst.sendall(data)
                tail = data[-len(self.answer) :]
        for end in (src, dst):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.released.set()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()


def _through_proxy(
    pg: Cluster, url: str, *, release_on_cancel: bool = True
) -> tuple[CommitHoldingProxy, Store]:
    """A store reaching the database of `url` through a proxy that can hold COMMIT replies."""
    proxy = CommitHoldingProxy(f"{pg.dir}/.s.PGSQL.{pg.port}", release_on_cancel=release_on_cancel)
    database = url.split("@/", 1)[1].split("?")[0]
    return proxy, Store.postgres(f"postgresql://postgres@127.0.0.1:{proxy.port}/{database}")


def _append_on_a_thread(
    store: Store, write: Callable[[], Awaitable[object]] | None = None
) -> tuple[threading.Thread, list[object]]:
    """`store.aappend("k", more)` (or `write()`) on a loop of its own thread; its result or
    error lands in the list once the thread ends."""
    outcome: list[object] = []

    async def append() -> None:
        try:
            if write is not None:
                outcome.append(await write())
                return
            outcome.append(await store.aappend("k", [ChunkRow.user("more")]))
        except BaseException as err:  # read by the test
            outcome.append(err)

    thread = threading.Thread(target=asyncio.run, args=(append(),))
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("pools", ["own pool", "runtime pool"])
def test_a_write_whose_commit_the_server_made_as_the_grace_ended_is_reported_landed(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch, pools: str
) -> None:
    # The server has committed the append; its answer is on its way when the close's grace
    # (0 here) ends. Cancelling the write's task then reports it failed, and psycopg raises
    # the cancellation whatever the answer: a phantom failure of a write that landed. The
    # close asks the server to cancel what still runs instead, and the write ends on what the
    # server answers (here: committed).
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0 if pools == "own pool" else 10**9)
    url = pg.new_database()
    proxy, store = _through_proxy(pg, url)

    try:
        store.append("k", [ChunkRow.user("hi")])
        proxy.armed.set()
        thread, outcome = _append_on_a_thread(store)
        assert proxy.holding.wait(GUARD)  # committed on the server, unheard by the store
        store.close(grace=0.0)
        thread.join(GUARD)
        with Store.postgres(url) as check:
            rows = [r.payload["content"] for r in check.conversation("k").rows]
        assert rows == ["hi", "more"]
        assert outcome == [2]  # landed, and said so
    finally:
        proxy.close()
        store.close()


def test_a_write_whose_server_never_answers_the_close_is_given_up_as_unknown(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server committed, and nothing of its answers reaches the store until the close has
    # returned (a network gone quiet): past `CANCEL_SECONDS` the close gives the write up. Its
    # caller gets a typed error that says the write may have landed, never one that says it
    # was rolled back.
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 10**9)
    monkeypatch.setattr(postgres_loops, "CANCEL_SECONDS", 0.2)
    url = pg.new_database()
    proxy, store = _through_proxy(pg, url, release_on_cancel=False)

    try:
        store.append("k", [ChunkRow.user("hi")])
        proxy.armed.set()
        thread, outcome = _append_on_a_thread(store)
        assert proxy.holding.wait(GUARD)
        store.close(grace=0.0)
        proxy.released.set()
        thread.join(GUARD)
        (error,) = outcome
        assert isinstance(error, StoreError), error
        assert "may have committed" in str(error)
        with Store.postgres(url) as check:
            assert [r.payload["content"] for r in check.conversation("k").rows] == ["hi", "more"]
    finally:
        proxy.close()
        store.close()


#: The server's answer to a pass's commit (one autocommit statement: `SELECT treadle_commit`).
_SELECTED_ONE = b"C\x00\x00\x00\x0dSELECT 1\x00"


async def _commit_more(store: Store) -> int:
    backend: Any = store.backend
    version: int = await backend.commit(
        "p1", "k", 1, [ChunkRow.user("more")], usage=Usage(), stop_reason="stop", metadata={},
        agent_rows=[],
    )  # fmt: skip
    return version


@pytest.mark.parametrize("write", ["append", "pass commit"])
@pytest.mark.parametrize("pools", ["own pool", "runtime pool"])
def test_a_write_whose_connection_is_lost_after_its_commit_was_sent_is_reported_unknown(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch, pools: str, write: str
) -> None:
    # The server committed the write; the link drops before its answer reaches the store (a
    # network failure, the server killed just then). The store cannot know the outcome: it
    # says so with a typed error (a caller retrying on a plain failure writes the turn twice).
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0 if pools == "own pool" else 10**9)
    url = pg.new_database()
    proxy, store = _through_proxy(pg, url, release_on_cancel=False)
    if write == "pass commit":  # its statement is its commit (autocommit)
        proxy.answer = _SELECTED_ONE

    try:
        store.append("k", [ChunkRow.user("hi")])
        proxy.armed.set()
        if write == "append":
            thread, outcome = _append_on_a_thread(store)
        else:
            thread, outcome = _append_on_a_thread(store, lambda: _commit_more(store))
        assert proxy.holding.wait(GUARD)  # committed on the server, unheard by the store
        for sock in proxy._sockets[1:]:  # the link drops (the listener stays)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        proxy.released.set()
        thread.join(GUARD)
        (error,) = outcome
        assert isinstance(error, WriteOutcomeUnknown), repr(error)
        assert "may have committed" in str(error)
        with Store.postgres(url) as check:
            assert [r.payload["content"] for r in check.conversation("k").rows] == ["hi", "more"]
    finally:
        proxy.close()
        store.close()


def test_a_write_whose_connection_is_lost_before_its_commit_was_sent_is_a_plain_failure(
    pg: Cluster,
) -> None:
    # The link drops while the append waits for the conversation's lock (its COMMIT not sent):
    # the server rolls it back, and the store says it failed (not that it may have landed).
    url = pg.new_database()
    proxy, store = _through_proxy(pg, url)
    held = Held.__new__(Held)  # only its lock-waiter count, on an admin connection
    import psycopg

    held.admin = psycopg.connect(url, autocommit=True)
    blocker = psycopg.connect(url, autocommit=True)
    try:
        store.append("k", [ChunkRow.user("hi")])
        blocker.execute("BEGIN")
        blocker.execute(HOLD_WRITE)
        thread, outcome = _append_on_a_thread(store)
        while not held._lock_waiters():
            threading.Event().wait(0.01)
        for sock in proxy._sockets[1:]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        thread.join(GUARD)
        blocker.execute("ROLLBACK")
        (error,) = outcome
        assert isinstance(error, StoreError), repr(error)
        assert not isinstance(error, WriteOutcomeUnknown), repr(error)
        assert held.rows() == ["hi"]
    finally:
        blocker.close()
        held.admin.close()
        proxy.close()
        store.close()


def test_closing_waits_within_grace_for_a_write_running_on_another_loops_pool(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The append runs on its own loop's pool (another thread's loop) when the close begins on
    # the main thread: the close lets it end within the grace, as on the runtime's pool, and
    # returns after it has landed (before the fix: at once, the write still running).
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    held = Held(pg, HOLD_WRITE)
    closing, seen = _closing_thread(held)
    try:
        pools = list(held.store.backend._loop_pools.values())
        assert [p.connections for p in pools] == [1]  # the append's loop's own pool
        closing.start()
        while closing.is_alive() and not pools[0].closed:  # its close has begun
            threading.Event().wait(0.01)
        held.release()
        closing.join(GUARD)
        held.thread.join(GUARD)
        assert seen == [["hi", "more"]]  # landed before the close returned
        assert held.outcome == [2]
    finally:
        held.end()


def test_one_grace_bounds_the_whole_close_of_every_pool(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two writes stuck on locks past the grace: one on the closing loop's own pool, one on the
    # runtime's. The grace is one deadline for both: the server is asked to cancel each as it
    # ends (before the fix the runtime's pool got a whole grace more once this loop's was shut).
    import psycopg

    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 10**9)
    held = Held(pg, HOLD_WRITE)  # "k": its append on the runtime's pool, by the hop
    blocker = psycopg.connect(held.url, autocommit=True)
    held.store.append("j", [ChunkRow.user("hi")])
    blocker.execute("BEGIN")
    blocker.execute("SELECT pg_advisory_xact_lock(hashtextextended('j', 0))")
    met = {"own": threading.Event(), "runtime": threading.Event()}
    seen: dict[str, bool] = {}
    real = postgres_loops.stop_writes

    async def main() -> list[object]:
        here = asyncio.get_running_loop()

        async def stop_writes(*args: Any) -> None:
            me = "own" if asyncio.get_running_loop() is here else "runtime"
            met[me].set()  # past the grace here: is the other pool past it too?
            other = met["runtime" if me == "own" else "own"]
            seen[me] = await asyncio.to_thread(other.wait, GUARD)
            await real(*args)

        monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
        monkeypatch.setattr(postgres_loops, "stop_writes", stop_writes)
        outcome: list[object] = []

        async def append() -> None:
            try:
                outcome.append(await held.store.aappend("j", [ChunkRow.user("more")]))
            except BaseException as err:  # read below
                outcome.append(err)

        task = asyncio.ensure_future(append())
        while held._lock_waiters() < 2:
            await asyncio.sleep(0.01)
        await held.store.aclose(grace=0.2)
        await task
        return outcome

    try:
        (own,) = asyncio.run(main())
        held.thread.join(GUARD)
        assert seen == {"own": True, "runtime": True}
        assert isinstance(own, StoreError), own
        assert isinstance(held.outcome[0], StoreError), held.outcome
        assert held.rows() == ["hi"]
    finally:
        blocker.close()
        held.release()
        held.end()


def test_a_second_close_waits_for_the_first_to_settle_the_writes(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two threads close the store while a write runs: the second close returns once the first
    # has let the write land (before the fix: at once, the write still running).
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 10**9)
    held = Held(pg, HOLD_WRITE)
    first = threading.Thread(target=held.store.close, kwargs={"grace": GUARD})
    closing, seen = _closing_thread(held)
    try:
        first.start()
        while first.is_alive() and not getattr(held.store.backend, "_closing_writes", None):
            threading.Event().wait(0.01)
        closing.start()
        closes = getattr(held.store, "_closing", None)  # the store's closes (`CloseOnce`)
        while closing.is_alive() and not (closes is not None and closes.waiters):
            threading.Event().wait(0.01)
        held.release()
        closing.join(GUARD)
        first.join(GUARD)
        held.thread.join(GUARD)  # the append's answer reaches its thread after the close
        assert seen == [["hi", "more"]]
        assert held.outcome == [2]
    finally:
        held.end()


def test_a_close_does_not_hang_on_another_loop_that_is_blocked(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another loop holds a pool of its own and is blocked (a sync call on it): its pool's
    # close cannot run there, so the store's close waits for it no longer than the grace.
    monkeypatch.setattr(postgres_loops, "OWN_POOL_AFTER", 0)
    store = Store.postgres(pg.new_database(), connect_timeout=60.0)
    ready, unblock = threading.Event(), threading.Event()

    async def blocked_loop() -> None:
        await store.aappend("k", [ChunkRow.user("hi")])  # its own pool, one connection
        ready.set()
        unblock.wait(GUARD)  # blocks this loop (on purpose)

    thread = threading.Thread(target=asyncio.run, args=(blocked_loop(),))
    thread.start()
    closing = threading.Thread(target=store.close, kwargs={"grace": 0.1})
    try:
        assert ready.wait(GUARD)
        closing.start()
        closing.join(GUARD)
        assert not closing.is_alive()  # returned, the other loop still blocked
        assert thread.is_alive()
    finally:
        unblock.set()
        thread.join(GUARD)
        closing.join(GUARD)


def test_calls_made_while_the_close_settles_the_commits_fail_and_the_commits_land(
    pg: Cluster,
) -> None:
    # The close first waits (within the grace) for the commits of passes already running; a
    # read or an append its caller makes meanwhile fails at once as closed (before the fix:
    # served, an append written after the close began), while the pass's commit still lands.
    import psycopg

    from treadle import Session, arun_session_loop
    from treadle.testing import ScriptedExecutor

    url = pg.new_database()
    store = Store.postgres(url, connect_timeout=60.0)
    store.append("k", [ChunkRow.user("hi")])
    admin = psycopg.connect(url, autocommit=True)
    blocker = psycopg.connect(url, autocommit=True)
    blocker.execute("BEGIN")
    blocker.execute(HOLD_WRITE)
    outcome: list[object] = []

    async def run_pass() -> None:
        try:
            outcome.append(
                await arun_session_loop(
                    Session.from_user_message("u"),
                    Session.from_agent_prompt("A."),
                    executor=ScriptedExecutor(["x"]),
                    store=store,
                    conversation="k",
                )
            )
        except BaseException as err:  # read below
            outcome.append(err)

    passing = threading.Thread(target=asyncio.run, args=(run_pass(),))
    closing = threading.Thread(target=store.close, kwargs={"grace": GUARD})
    late: dict[str, object] = {}
    try:
        passing.start()
        waiting = Held.__new__(Held)
        waiting.admin = admin
        while not waiting._lock_waiters():  # the pass's commit waits for the lock
            threading.Event().wait(0.01)
        closing.start()
        closes = getattr(store, "_closing", None)
        while closing.is_alive() and not (closes is not None and closes.begun):
            threading.Event().wait(0.01)
        for name, call in (
            ("read", lambda: store.conversations()),
            ("append", lambda: store.append("z", [ChunkRow.user("late")])),
        ):
            try:
                late[name] = call()
            except StoreError as err:
                late[name] = err
        blocker.execute("ROLLBACK")
        closing.join(GUARD)
        passing.join(GUARD)
        assert all(isinstance(e, StoreError) and "closed" in str(e) for e in late.values()), late
        assert [type(o).__name__ for o in outcome] == ["Session"], outcome
        assert held_rows(admin, "z") == []
        assert held_rows(admin, "k")[:2] == ["hi", "u"]  # the pass's turn landed
    finally:
        blocker.close()
        admin.close()
        passing.join(GUARD)
        closing.join(GUARD)


def held_rows(admin: Any, key: str) -> list[str]:
    """Conversation `key`'s rows in the database now (their content)."""
    found = admin.execute(
        "SELECT payload FROM treadle_rows WHERE key = %s ORDER BY seq", (key,)
    ).fetchall()
    return [str(json.loads(payload)["content"]) for (payload,) in found]
