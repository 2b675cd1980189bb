"""A read that fails fails alone: conversations read in the same batch as a conversation whose
stored rows are damaged (rewritten by hand in SQL), or as a key the database cannot hold (an
emoji on a LATIN1 PostgreSQL database), still get their rows; only the failing key sees its
error. Real parts: a SQLite file, a throwaway PostgreSQL cluster (tests/pg_cluster.py)."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import FrozenInstanceError, fields
from typing import Any

import pytest

from pg_cluster import Cluster, latin1_database
from treadle import Session, run_session_loop
from treadle.errors import StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores import Store
from treadle.stores.records import _SETS, StoredConversation, stored_conversation
from treadle.testing import ScriptedExecutor

AGENT = Session.from_agent_prompt("Answer briefly.")
DAMAGED = '{"role":"user","content":{"not":"text"},"x":1}'
EMOJI = "\U0001f600"


def _damage(url: str, key: str) -> None:
    """Rewrite `key`'s stored row behind the store's back, as a hand-written SQL fix might."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            assert conn.execute(
                "UPDATE rows SET payload = ? WHERE key = ?", (DAMAGED, key)
            ).rowcount
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute("UPDATE treadle_rows SET payload = %s WHERE key = %s", (DAMAGED, key))
        assert cur.rowcount == 1


def _read_all(store: Store, keys: list[str]) -> dict[str, Any]:
    """Every key's texts, or its error: the reads are started together (one batch, or two)."""
    lazy = [(key, store.conversation(key)) for key in keys]
    out: dict[str, Any] = {}
    for key, session in lazy:
        try:
            out[key] = [r.content for r in session.rows]
        except StoreError as err:
            out[key] = err
    return out


def test_a_damaged_conversation_fails_only_its_own_read(url: str) -> None:
    keys = ["a", "b", "bad", "c"]
    with Store.open(url) as store:
        for key in keys:
            store.append(key, [ChunkRow.user(key)])
    _damage(url, "bad")
    for _ in range(3):
        with Store.open(url) as store:  # a fresh cache: every row is read from the database
            out = _read_all(store, keys)
        assert {k: v for k, v in out.items() if k != "bad"} == {"a": ["a"], "b": ["b"], "c": ["c"]}
        assert isinstance(out["bad"], StoreError)
        assert "conversation 'bad' holds an invalid row" in str(out["bad"])


def test_a_postgres_read_batch_with_a_damaged_conversation_fails_only_that_key(
    pg: Cluster,
) -> None:
    """The batch itself, with every key in it for certain: one result per key."""
    url = pg.new_database()
    keys = ["a", "bad", "c", "new"]
    with Store.open(url) as store:
        for key in keys[:3]:
            store.append(key, [ChunkRow.user(key)])
    _damage(url, "bad")

    async def main() -> list[Any]:
        async with Store.postgres(url) as store:
            backend: Any = store.backend
            return list(await backend._on_runtime(lambda: backend._load_many(keys)))

    a, bad, c, new = asyncio.run(main())
    assert isinstance(a, StoredConversation) and [r.content for r in a.rows] == ["a"]
    assert isinstance(c, StoredConversation) and [r.content for r in c.rows] == ["c"]
    assert isinstance(new, StoredConversation) and new.rows == ()
    assert isinstance(bad, StoreError) and "conversation 'bad'" in str(bad)


def test_a_key_a_latin1_database_cannot_hold_fails_only_its_own_read_and_pass(
    pg: Cluster,
) -> None:
    """A read batch that fails is read again key by key, as a commit batch is committed again
    pass by pass: the emoji key alone gets the `StoreError`."""
    url = latin1_database(pg)
    keys = ["a", "b", EMOJI, "c"]
    with Store.open(url) as store:
        for key in ("a", "b", "c"):
            store.append(key, [ChunkRow.user(key)])
        for _ in range(3):
            out = _read_all(store, keys)
            assert {k: v for k, v in out.items() if k != EMOJI} == {
                "a": ["a"], "b": ["b"], "c": ["c"],
            }  # fmt: skip
            assert isinstance(out[EMOJI], StoreError)
            assert "LATIN1" in str(out[EMOJI])
        passes = [
            (key, run_session_loop(
                Session.from_user_message("hi"), AGENT, executor=ScriptedExecutor(["ok"]),
                store=store, conversation=key,
            ))
            for key in ("p", EMOJI, "q", "r")
        ]  # fmt: skip
        versions: dict[str, Any] = {}
        for key, outcome in passes:
            try:
                versions[key] = outcome.metadata["version"]
            except StoreError as err:
                versions[key] = err
        assert {k: v for k, v in versions.items() if k != EMOJI} == {"p": 2, "q": 2, "r": 2}
        assert isinstance(versions[EMOJI], StoreError)


def test_a_postgres_read_batch_that_fails_is_read_again_key_by_key(pg: Cluster) -> None:
    url = latin1_database(pg)
    with Store.open(url) as store:
        store.append("a", [ChunkRow.user("a")])

    async def main() -> list[Any]:
        async with Store.postgres(url) as store:
            backend: Any = store.backend
            batch = ["a", EMOJI, "new"]
            return list(await backend._on_runtime(lambda: backend._load_many(batch)))

    a, emoji, new = asyncio.run(main())
    assert [r.content for r in a.rows] == ["a"] and new.rows == ()
    assert isinstance(emoji, StoreError) and "LATIN1" in str(emoji)


def test_the_read_paths_stored_conversation_is_the_dataclass_whole_and_frozen() -> None:
    # Reads build their StoredConversation through its slots' setters (not the frozen
    # __init__): every field set, the same value, equality and repr, still frozen. A field
    # added to the dataclass and not to the builder fails the first assert.
    assert len(_SETS) == len(fields(StoredConversation))
    rows = (ChunkRow.user("hi"),)
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3, requests=1)
    built = stored_conversation("k", rows, usage, "stop", {"a": 1}, "parent", 3)
    made = StoredConversation("k", rows, usage, "stop", {"a": 1}, "parent", 3)
    assert built == made and repr(built) == repr(made) and built.version == 1
    assert type(built) is StoredConversation
    with pytest.raises(FrozenInstanceError):
        built.key = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "usage",
    ['{"prompt_tokens": "abc"}', '{"prompt_tokens": 1e400}', '{"requests": [1]}'],
    ids=["text", "huge", "list"],
)
def test_a_head_with_damaged_usage_fails_only_its_own_read_with_a_store_error(
    url: str, usage: str
) -> None:
    keys = ["good1", "bad", "good2"]
    with Store.open(url) as store:
        for key in keys:
            store.append(key, [ChunkRow.user(key)])
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.execute("UPDATE conversations SET usage = ? WHERE key = 'bad'", (usage,))
    else:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE treadle_conversations SET usage = %s WHERE key = 'bad'", (usage,))
    with Store.open(url) as store:  # a fresh cache: the heads are read from the database
        lazy = [(key, store.conversation(key)) for key in keys]  # read together: one batch
        out: dict[str, Any] = {}
        for key, session in lazy:
            try:
                out[key] = [r.content for r in session.rows]
            except Exception as err:  # its type is what is checked
                out[key] = err
    assert out["good1"] == ["good1"] and out["good2"] == ["good2"]
    assert isinstance(out["bad"], StoreError), repr(out["bad"])
    assert "conversation 'bad'" in str(out["bad"]) and "usage" in str(out["bad"])
