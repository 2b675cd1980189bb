"""Retention racing running passes, and what a delete or prune leaves behind. A pass that read a
conversation which was then deleted (and maybe started again under the same key by someone
else) never writes onto the new conversation, and never writes its pass record or journal (the
deleted user's text) back; `delete` and `prune` also remove the records of passes that never
committed (first turns cancelled on new keys).

Real parts: a SQLite file and a throwaway PostgreSQL database (the `url` fixture), the scripted
executor; the races are ordered by events (a tool that waits for its gate), never by sleeps.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest

from treadle import Session, arun_session_loop, tool
from treadle.errors import ConflictError
from treadle.session import ChunkRow, Usage
from treadle.stores import Store
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_call

AGENT = Session.from_agent_prompt("Look things up when asked.")

_TABLES = ("conversations", "rows", "passes", "journal")


def _everything(url: str) -> str:
    """Every value of every store table, as one text (what a deleted user's text must not be
    found in)."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            found = [conn.execute(f"SELECT * FROM {t}").fetchall() for t in _TABLES]
        return repr(found)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        found = [conn.execute(f"SELECT * FROM treadle_{t}").fetchall() for t in _TABLES]
    return repr(found)


def _counts(url: str) -> tuple[int, int]:
    """(pass records, journal rows) in the store."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            passes = conn.execute("SELECT count(*) FROM passes").fetchone()[0]
            journal = conn.execute("SELECT count(*) FROM journal").fetchone()[0]
        return int(passes), int(journal)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        p = conn.execute("SELECT count(*) FROM treadle_passes").fetchone()
        j = conn.execute("SELECT count(*) FROM treadle_journal").fetchone()
    return int(p[0]) if p else 0, int(j[0]) if j else 0


class _Gate:
    """A tool that says when it has started and returns only when the test lets it."""

    def __init__(self, result: str) -> None:
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        me = self

        @tool
        async def slow(x: str) -> str:
            """Look `x` up (slowly)."""
            me.started.set()
            await me.gate.wait()
            return result

        self.tool = slow


def _pass(store: Store, key: str, text: str, gate: _Gate) -> asyncio.Future[Any]:
    model = ScriptedExecutor([tool_call("slow", {"x": "1"}), f"{text} answer"])
    return asyncio.ensure_future(
        arun_session_loop(
            Session.from_user_message(text),
            AGENT,
            executor=model,
            tools=[gate.tool],
            store=store,
            conversation=key,
        )
    )


def test_a_pass_on_a_conversation_deleted_and_started_again_conflicts(url: str) -> None:
    """ABA: the pass read 'k' at version 2; 'k' is deleted and a new user's conversation
    reaches version 2 under the same key before the pass commits. The pass must not land on
    the new conversation (the version alone matches), nor bring back the old user's text."""

    async def main() -> None:
        gate = _Gate("OLD-SECRET result")
        async with Store.open(url) as store:
            await store.aappend(
                "k", [ChunkRow.user("OLD-SECRET card"), ChunkRow("assistant", {"content": "ok"})]
            )
            old = _pass(store, "k", "OLD-SECRET question", gate)
            await gate.started.wait()  # its assistant row and intent are in the journal
            assert await store.adelete("k")
            await arun_session_loop(
                Session.from_user_message("new user: hello"), AGENT,
                executor=ScriptedExecutor(["hi new user"]), store=store, conversation="k",
            )  # fmt: skip
            gate.gate.set()
            with pytest.raises(ConflictError, match="deleted"):
                await old
            await store.asettled()
            rows = (await store.conversation("k")).rows
            assert [r.content for r in rows] == ["new user: hello", "hi new user"]
            assert await store.apending() == []
        assert "OLD-SECRET" not in _everything(url)

    asyncio.run(main())


@pytest.mark.parametrize("existing", [True, False], ids=["existing", "first-turn"])
def test_a_pass_running_when_its_conversation_is_deleted_writes_nothing_back(
    url: str, existing: bool
) -> None:
    async def main() -> None:
        gate = _Gate("SECRET-TOPIC result")
        async with Store.open(url) as store:
            if existing:
                await store.aappend(
                    "k",
                    [ChunkRow.user("SECRET-TOPIC hello"), ChunkRow("assistant", {"content": "hi"})],
                )
            running = _pass(store, "k", "my SECRET-TOPIC question", gate)
            await gate.started.wait()
            assert await store.adelete("k")  # a first turn's record alone counts too
            gate.gate.set()
            with pytest.raises(ConflictError, match="deleted"):
                await running
            await store.asettled()
            assert await store.apending() == []
            assert await store.aconversations() == []
        assert _counts(url) == (0, 0)
        assert "SECRET-TOPIC" not in _everything(url)

    asyncio.run(main())


def test_delete_and_prune_remove_records_of_first_turns_that_never_committed(url: str) -> None:
    """First turns cancelled on new keys (the client went away) leave resumable records and
    journal rows but no conversation: `delete(key)` removes them (and says so), `prune`
    removes those older than its cutoff."""

    async def main() -> None:
        async with Store.open(url) as store:
            for i in range(3):
                gate = _Gate("never")
                running = _pass(store, f"user-{i}", f"private text of user {i}", gate)
                await gate.started.wait()
                running.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await running
            await store.asettled()
            assert len(await store.apending()) == 3
            assert _counts(url)[0] == 3
            assert await store.adelete("user-0")
            assert "user 0" not in _everything(url)
            assert await store.aprune(older_than_days=1) == 0  # younger than the cutoff: kept
            assert len(await store.apending()) == 2
            assert await store.aprune(older_than_days=0) == 2
            assert await store.apending() == []
            assert await store.adelete("user-1") is False  # nothing left of it
        assert _counts(url) == (0, 0)
        assert "private text" not in _everything(url)

    asyncio.run(main())


async def _commit(store: Store, pass_id: str, key: str, base: int, **kw: Any) -> int:
    backend: Any = store.backend
    version: int = await backend.commit(
        pass_id, key, base, [ChunkRow.user(f"{pass_id} row")], usage=Usage(),
        stop_reason="stop", metadata={}, agent_rows=[], **kw,
    )  # fmt: skip
    return version


def test_the_commit_itself_checks_the_conversation_it_read(url: str) -> None:
    """The commit paths alone (no journal write after the delete: a pass whose model answers
    while the key is deleted and started again): a commit based on the old conversation is a
    `ConflictError` when sent alone and when batched with another pass's commit, which lands;
    a recorded pass whose record a delete took conflicts too, even on a key that is new again."""

    async def main() -> None:
        async with Store.open(url) as store:
            await store.aappend("k", [ChunkRow.user("OLD-SECRET a"), ChunkRow.user("b")])
            read = await store.backend.load("k")
            assert read.created_at is not None
            assert await store.adelete("k")
            await store.aappend("k", [ChunkRow.user("new a"), ChunkRow.user("new b")])
            with pytest.raises(ConflictError, match="deleted"):
                await _commit(store, "alone", "k", 2, recorded=False, born=read.created_at)
            stale, fresh = await asyncio.gather(
                _commit(store, "stale", "k", 2, recorded=False, born=read.created_at),
                _commit(store, "fresh", "other", 0, recorded=False, born=0.0),
                return_exceptions=True,
            )
            assert isinstance(stale, ConflictError) and fresh == 1
            now = await store.backend.load("k")
            assert [r.content for r in now.rows] == ["new a", "new b"]
            assert await _commit(store, "current", "k", 2, recorded=False, born=now.created_at) == 3
            # A recorded first turn on a new key whose record a delete took: its commit would
            # bring the deleted text back under the key.
            backend: Any = store.backend
            await backend.record(
                "gone", "n", 0, [], [("row", ChunkRow.user("OLD-SECRET q"))], start=0, born=0.0
            )
            assert await store.adelete("n")
            with pytest.raises(ConflictError):
                await _commit(store, "gone", "n", 0, recorded=True, born=0.0)
            with pytest.raises(ConflictError, match="deleted"):  # and its later writes
                await backend.record(
                    "gone", "n", 0, [], [("row", ChunkRow.user("OLD-SECRET r"))], start=1,
                    born=0.0,
                )  # fmt: skip
            assert await store.aconversations() != [] and (await store.backend.load("n")).rows == ()
        assert "OLD-SECRET" not in _everything(url)

    asyncio.run(main())
