"""Queue mode: a conversation's lock outlives nothing that holds it.

- The store closed while a pass holds the lock mid-tool: the pass fails with `StoreError` and
  the lock is given back (a new store runs a pass on the key).
- A tool that forks (a `multiprocessing` helper): the child does not keep the parent's lock
  files (an `flock` lives while any copy of its file is open).
- An append left on a closed loop while it waits for another client's write lock keeps the
  conversation's lock until it lands: a queued pass after it meets no `ConflictError`.
- A tool that runs a sub-pass on another conversation of the same store: the outer pass that
  lost its lock (its PostgreSQL connection ended) still fails with `StoreError`.

Real SQLite files and the tests' throwaway PostgreSQL cluster; `wait_for` bounds are guards
against a hang, not timings.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pg_cluster import Cluster
from treadle import Session, arun_session_loop, tool
from treadle.errors import StoreError
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

#: Tasks of loops these tests close on purpose, kept for the session: collected mid-suite,
#: a coroutine would run its `finally` blocks inside another test (GeneratorExit, asyncio's
#: destroyed-task log).
KEEP: list[asyncio.Task[Any]] = []
AGENT = Session.from_agent_prompt("A.")
GUARD = 30.0


async def _later_pass(url: str) -> int:
    """A pass on `k` from a new store: its version (a hang fails the guard)."""
    store = Store.open(url, on_conflict="queue")
    try:
        out = await asyncio.wait_for(
            arun_session_loop(
                Session.from_user_message("later"), AGENT, executor=ScriptedExecutor(["x"]),
                store=store, conversation="k",
            ),
            GUARD,
        )  # fmt: skip
        return int(out.metadata["version"])
    finally:
        await store.aclose(grace=5)


async def test_closing_the_store_mid_pass_gives_the_conversation_lock_back(url: str) -> None:
    started = asyncio.Event()

    @tool
    async def nap() -> str:
        """Nap."""
        started.set()
        await asyncio.sleep(0.5)
        return "ok"

    store = Store.open(url, on_conflict="queue")
    task = asyncio.ensure_future(
        arun_session_loop(
            Session.from_user_message("m"), AGENT,
            executor=ScriptedExecutor([tool_call("nap", {}), "a"]), tools=[nap],
            store=store, conversation="k",
        )
    )  # fmt: skip
    await asyncio.wait_for(started.wait(), GUARD)
    await store.aclose(grace=1)
    with pytest.raises(StoreError):
        await asyncio.wait_for(task, GUARD)
    assert await _later_pass(url) == 2


def _sleep_long() -> None:
    time.sleep(60)


async def test_a_forked_helper_does_not_keep_the_conversation_locked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    children: list[multiprocessing.process.BaseProcess] = []

    @tool
    def spawn() -> str:
        """Start a helper process (forked)."""
        child = multiprocessing.get_context("fork").Process(target=_sleep_long, daemon=True)
        child.start()
        children.append(child)
        return "started"

    store = Store.open(url, on_conflict="queue")
    try:
        await arun_session_loop(
            Session.from_user_message("m"), AGENT,
            executor=ScriptedExecutor([tool_call("spawn", {}), "a"]), tools=[spawn],
            store=store, conversation="k",
        )  # fmt: skip
        assert children and children[0].is_alive()
        assert await _later_pass(url) == 6
    finally:
        await store.aclose(grace=5)
        for child in children:
            child.kill()
            child.join()


def test_an_append_left_on_a_closed_loop_keeps_the_lock_until_it_lands(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    store = Store.open(url, on_conflict="queue")
    try:
        store.append("k", [ChunkRow.user("first")])
        held = threading.Event()

        def other_client() -> None:  # holds the file's write lock for a while
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            held.set()
            time.sleep(1.5)
            conn.execute("COMMIT")
            conn.close()

        blocker = threading.Thread(target=other_client)
        blocker.start()
        held.wait()
        loop = asyncio.new_event_loop()

        pending: list[asyncio.Task[int]] = []

        async def orphan() -> None:
            pending.append(loop.create_task(store.aappend("k", [ChunkRow.user("orphan")])))
            await asyncio.sleep(0.3)  # the append waits on the write lock

        loop.run_until_complete(orphan())
        KEEP.extend(asyncio.all_tasks(loop))  # see KEEP
        loop.close()  # without cancelling: the append is in flight on the database thread
        time.sleep(0.5)  # longer than the lock watcher's period

        async def queued() -> int:
            out = await asyncio.wait_for(
                arun_session_loop(
                    Session.from_user_message("other"), AGENT,
                    executor=ScriptedExecutor(["x"]), store=store, conversation="k",
                ),
                GUARD,
            )  # fmt: skip
            return int(out.metadata["version"])

        assert asyncio.run(queued()) == 4  # after the orphaned append: no ConflictError
        blocker.join()
        kinds = [r.payload.get("content") for r in store.conversation("k").rows]
        assert kinds[:3] == ["first", "orphan", "other"]
    finally:
        store.close(grace=5)


async def test_a_sub_pass_does_not_hide_a_lost_lock_of_the_pass_around_it(pg: Cluster) -> None:
    import psycopg

    url = pg.new_database()
    store = Store.open(url, on_conflict="queue")
    napping = asyncio.Event()

    @tool
    async def work() -> str:
        """Run a sub-agent on another conversation, then nap."""
        await arun_session_loop(
            Session.from_user_message("sub"), AGENT, executor=ScriptedExecutor(["sub answer"]),
            store=store, conversation="sub",
        )  # fmt: skip
        napping.set()
        await asyncio.sleep(1.0)
        return "ok"

    try:
        await store.aappend("k", [])
        first = asyncio.ensure_future(
            arun_session_loop(
                Session.from_user_message("first"), AGENT,
                executor=ScriptedExecutor([tool_call("work", {}), "a"]), tools=[work],
                store=store, conversation="k",
            )
        )  # fmt: skip
        await asyncio.wait_for(napping.wait(), GUARD)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            )
            for (pid,) in await cur.fetchall():
                await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        second = await asyncio.wait_for(
            arun_session_loop(
                Session.from_user_message("second"), AGENT, executor=ScriptedExecutor(["b"]),
                store=store, conversation="k",
            ),
            GUARD,
        )  # fmt: skip
        assert second.metadata["version"] == 2
        with pytest.raises(StoreError, match="lost the lock"):
            await asyncio.wait_for(first, GUARD)
    finally:
        await store.aclose(grace=5)
