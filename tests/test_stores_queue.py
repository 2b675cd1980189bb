"""Queue-per-conversation mode (`on_conflict="queue"`), on both backends: passes on one
conversation run one after another, each from the rows the previous one committed, across
threads, loops and processes, instead of the later one failing with `ConflictError`.

Real parts: a SQLite file and its lock files, a throwaway PostgreSQL cluster, the fake OpenAI
server over HTTP, and 50 real appender processes (tests/store_worker.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treadle import Session, arun_session_loop, run_session_loop
from treadle import tool as make_tool
from treadle.errors import ConfigurationError
from treadle.llm.request import CompletionRequest
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.testing import FakeOpenAIServer, ScriptedExecutor
from treadle.testing.postgres import PostgresCluster
from treadle.testing.scripted import tool_call

WORKER = str(Path(__file__).with_name("store_worker.py"))
AGENT = Session.from_agent_prompt("Answer briefly.")
#: Generous: the suite must pass on a loaded 2-core machine.
CHILD_TIMEOUT = 240


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    opened = Store.open(url, on_conflict="queue")
    yield opened
    opened.close()


def _texts(session: Session) -> list[tuple[str, str]]:
    return [(r.kind, str(r.content)) for r in session.rows]


def test_on_conflict_takes_raise_or_queue(tmp_path: Path) -> None:
    assert Store.sqlite(tmp_path / "a.db").on_conflict == "raise"
    assert Store.open(f"sqlite:///{tmp_path / 'b.db'}", on_conflict="queue").on_conflict == "queue"
    with pytest.raises(ConfigurationError, match="'raise' or 'queue'"):
        Store.sqlite(tmp_path / "c.db", on_conflict="wait")  # type: ignore[arg-type]


def test_a_second_pass_waits_for_the_first_and_starts_from_its_rows(store: Store) -> None:
    started, release = threading.Event(), threading.Event()

    @make_tool
    def slow() -> str:
        """Wait for the test."""
        started.set()
        release.wait(CHILD_TIMEOUT)
        return "done"

    first = run_session_loop(
        Session.from_user_message("first"),
        AGENT,
        executor=ScriptedExecutor([tool_call("slow", {}), "first answer"]),
        tools=[slow],
        store=store,
        conversation="q",
    )
    assert started.wait(CHILD_TIMEOUT)  # the first pass holds the conversation
    seen: list[int] = []

    def answer(request: CompletionRequest) -> str:
        seen.append(len(request.messages()))
        return "second answer"

    second = run_session_loop(
        Session.from_user_message("second"),
        AGENT,
        executor=ScriptedExecutor(default=answer),
        store=store,
        conversation="q",
    )
    time.sleep(0.3)  # room for a wrong implementation to go ahead; nothing asserts a duration
    assert not second.done() and seen == []
    release.set()
    assert (first.metadata["version"], second.metadata["version"]) == (4, 6)
    assert seen == [6]  # system, the first pass's 4 rows, its own question
    assert _texts(store.conversation("q")) == [
        ("user", "first"), ("assistant", "None"), ("tool_result", '{"ok":true,"result":"done"}'),
        ("assistant", "first answer"), ("user", "second"), ("assistant", "second answer"),
    ]  # fmt: skip


async def test_concurrent_passes_on_one_loop_queue_and_all_commit(store: Store) -> None:
    outs = await asyncio.gather(
        *(
            arun_session_loop(
                Session.from_user_message(f"m{i}"),
                AGENT,
                executor=ScriptedExecutor([f"a{i}"]),
                store=store,
                conversation="many",
            )
            for i in range(8)
        )
    )
    assert sorted(o.metadata["version"] for o in outs) == [2 * k for k in range(1, 9)]
    rows = (await store.conversation("many").wait_ready()).table.rows
    pairs = [(str(rows[i].content), str(rows[i + 1].content)) for i in range(0, 16, 2)]
    assert sorted(pairs) == sorted((f"m{i}", f"a{i}") for i in range(8))


def test_an_append_waits_for_the_running_pass(store: Store) -> None:
    started, release = threading.Event(), threading.Event()

    @make_tool
    def slow() -> str:
        """Wait for the test."""
        started.set()
        release.wait(CHILD_TIMEOUT)
        return "done"

    running = run_session_loop(
        Session.from_user_message("work"),
        AGENT,
        executor=ScriptedExecutor([tool_call("slow", {}), "worked"]),
        tools=[slow],
        store=store,
        conversation="a",
    )
    assert started.wait(CHILD_TIMEOUT)
    appended: list[int] = []
    appender = threading.Thread(
        target=lambda: appended.append(store.append("a", [ChunkRow.user("note")]))
    )
    appender.start()
    appender.join(0.3)
    assert appended == []  # still waiting behind the pass
    release.set()
    assert running.metadata["version"] == 4
    appender.join(CHILD_TIMEOUT)
    assert appended == [5]


def test_a_cancelled_waiter_leaves_the_lock_free(store: Store) -> None:
    started, release = threading.Event(), threading.Event()

    @make_tool
    def slow() -> str:
        """Wait for the test."""
        started.set()
        release.wait(CHILD_TIMEOUT)
        return "done"

    holder = run_session_loop(
        Session.from_user_message("hold"),
        AGENT,
        executor=ScriptedExecutor([tool_call("slow", {}), "held"]),
        tools=[slow],
        store=store,
        conversation="c",
    )
    assert started.wait(CHILD_TIMEOUT)
    waiter = run_session_loop(
        Session.from_user_message("gives up"),
        AGENT,
        executor=ScriptedExecutor(["never"]),
        store=store,
        conversation="c",
    )
    time.sleep(0.3)  # most likely waiting for the lock by now (either way the lock must be free)
    waiter.cancel()
    release.set()
    assert holder.metadata["version"] == 4
    assert waiter.synchronize(CHILD_TIMEOUT).stop_reason == "cancelled"
    assert "version" not in waiter.metadata  # it committed nothing
    after = run_session_loop(
        Session.from_user_message("next"),
        AGENT,
        executor=ScriptedExecutor(["next answer"]),
        store=store,
        conversation="c",
    )
    assert after.metadata["version"] == 6  # the lock came back: nothing waits for the waiter


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fifty_queued_appender_processes_each_start_from_the_last_commit(url: str) -> None:
    with FakeOpenAIServer(script="echo") as server:
        launcher = subprocess.Popen(
            [sys.executable, WORKER, "fanout", url, "shared", server.base_url, "50", "queue"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        out, err = launcher.communicate(timeout=CHILD_TIMEOUT * 3)
        sizes = sorted(len(r.body["messages"]) for r in server.requests if r.body)
    assert launcher.returncode == 0, err  # no child met a ConflictError or any other error
    assert "ConflictError" not in err
    versions = sorted(int(line.split()[1]) for line in out.splitlines())
    assert versions == [2 * k for k in range(1, 51)]  # each pass committed once, in turn
    # Each pass's request held every row committed before it: system + 2k rows + its question.
    assert sizes == [2 + 2 * k for k in range(50)]
    with Store.open(url) as store:
        rows = store.conversation("shared").rows
    assert len(rows) == 100
    pairs = [(rows[i], rows[i + 1]) for i in range(0, 100, 2)]
    for user, answer in pairs:  # nothing interleaved: each question, then its own answer
        assert (user.kind, answer.kind) == ("user", "assistant")
        assert answer.content == user.content
    assert sorted(str(u.content) for u, _ in pairs) == sorted(f"msg {i}" for i in range(50))


def test_a_lock_granted_as_its_caller_is_cancelled_is_given_back(pg: PostgresCluster) -> None:
    # Waiting for a conversation's PostgreSQL lock runs on the runtime's loop; a caller on
    # another loop that is cancelled just as the server grants it got nothing back, and the
    # lock's connection stayed open holding it: every later pass on the conversation waited
    # forever (seen in test_stores_cancel's queue mode under load). `run` here finishes the
    # wait and then cancels the caller, the exact window, every time.
    import psycopg

    from treadle.stores.queueing import PostgresKeyLock

    dsn = pg.new_database()

    async def granted_then_cancelled(fn: Any, cancellable: bool) -> Any:
        if not cancellable:  # the release
            return await fn()
        await fn()
        raise asyncio.CancelledError

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await PostgresKeyLock.acquire(dsn, "k", 5.0, granted_then_cancelled)
        probe = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            cur = await probe.execute("SELECT pg_try_advisory_lock(hashtextextended('k', 1))")
            row = await cur.fetchone()
            assert row is not None and row[0] is True  # free: the granted lock was given back
        finally:
            await probe.close()

    asyncio.run(main())
