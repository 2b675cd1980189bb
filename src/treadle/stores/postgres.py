"""The PostgreSQL conversation store: psycopg 3, async, pooled (the `treadle[postgres]` extra).

The store's first pool lives on the Treadle runtime's event loop and every call can reach it
from any loop; a loop that uses the store enough gets a pool of its own (see
`treadle.stores.postgres_home.PostgresHome`, this backend's base, and
`treadle.stores.postgres_loops`). The first use connects once
with a timeout, so a DSN that does not connect is a `ConfigurationError` naming what failed,
fast; then it creates or migrates the schema under an advisory lock (several processes may
start at once). Every write is one transaction holding a per-conversation advisory lock, so a
version check and its insert are never split by another writer. A connection lost later is a
`StoreError`; the transaction it was in is rolled back by the server, so a conversation is
never half-written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.errors import ConflictError, StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores.batching import OFF_LOOP_ROWS, Batcher, encode_rows
from treadle.stores.pass_records import (
    pending_list,
    waiting_error,
)
from treadle.stores.postgres_batch import commit_call, commit_many, commit_task, load_many
from treadle.stores.postgres_loops import LoopPool, PoolRefused
from treadle.stores.postgres_open import DB_NOW
from treadle.stores.postgres_outcome import committing
from treadle.stores.postgres_passes import PostgresPasses
from treadle.stores.postgres_retention import PRUNE_CHUNK, delete_conversations, prune_orphans
from treadle.stores.postgres_rows import write_rows
from treadle.stores.queueing import KeyLock, PostgresKeyLock
from treadle.stores.records import (
    ConversationInfo,
    PendingPass,
    StoredConversation,
    conflict_error,
    decode_json,
    exists_error,
    fork_point,
    rows_text,
)

if TYPE_CHECKING:
    from psycopg import AsyncConnection


__all__ = ["PostgresBackend"]

T = TypeVar("T")


class PostgresBackend(PostgresPasses):
    """A conversation store in a PostgreSQL database (see the module docstring)."""

    def _batchers(
        self,
    ) -> tuple[Batcher[str, StoredConversation], Batcher[tuple[Any, ...], int]]:
        """The batched reads and commits: the running loop's own (see `_local`), or those run
        on the runtime's loop and awaited from any loop without a task there per call (see
        `Batcher`)."""
        local = self._local()
        if local is not None:
            if local.batchers is None:
                local.batchers = (
                    Batcher(functools.partial(self._load_many, local=local), home=local.loop),
                    Batcher(functools.partial(self._commit_many, local=local), home=local.loop),
                )
            return local.batchers
        runtime = self._home()
        loads, commits = self._loads, self._commits
        if loads is None or commits is None:
            loads = self._loads = Batcher(self._load_many, home=runtime.loop)
            commits = self._commits = Batcher(self._commit_many, home=runtime.loop)
            self._handovers += [loads, commits]
        return loads, commits

    # -- the protocol ---------------------------------------------------------------------------
    async def load(self, key: str) -> StoredConversation:
        """The committed conversation (empty for a new key). Reads made at once share their
        queries (`postgres_batch.load_many`); only rows not cached are fetched and decoded."""

        return await self._batchers()[0](key)

    async def _load_many(
        self, keys: list[str], local: LoopPool | None = None
    ) -> list[StoredConversation | BaseException]:
        """Read a batch (on `local`, a loop's own pool, or the runtime's): each key's
        conversation, or its own error (a read that failed alone: see
        `postgres_batch.load_many`)."""
        import psycopg

        async def body(where: LoopPool | None = local) -> list[StoredConversation | BaseException]:
            async with self._connection(where) as conn:
                return await load_many(conn, keys, self._cache)

        try:
            results = await self._guarded(body)
        except PoolRefused:  # nothing was sent: the runtime's pool waits for a connection
            results = await self._on_runtime(functools.partial(body, None))
        return [self._failed(r) if isinstance(r, psycopg.Error) else r for r in results]

    async def _commit_many(
        self, calls: list[tuple[Any, ...]], local: LoopPool | None = None
    ) -> list[int | BaseException]:
        """Commit a batch (on `local`, or the runtime's pool; each call's last item is its rows
        and usage, for the cache); a conflict is a negative version, as `treadle_commit`
        returns it."""
        import psycopg

        async def body(where: LoopPool | None = local) -> list[int | BaseException]:
            async with self._connection(where) as conn:
                return await commit_many(conn, [call[:-1] for call in calls])

        try:
            results = await self._guarded(body)
        except PoolRefused:  # nothing was sent: the runtime's pool waits for a connection
            results = await self._on_runtime(functools.partial(body, None))
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, int) and result >= 0:
                rows, usage = call[-1]
                # A new key is cached by its first read; `born` (call[12]): the conversation
                # the commit checked, not one a delete and a new first turn made meanwhile.
                self._cache.extend(call[1], call[2], rows, call[12])
                self._cache.keep_usage(call[1], call[5], usage)  # the next read's head
        return [self._failed(r) if isinstance(r, psycopg.Error) else r for r in results]

    async def commit(
        self,
        pass_id: str,
        key: str,
        base: int,
        rows: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
        agent_rows: Sequence[ChunkRow],
        recorded: bool = True,
        born: float | None = None,
    ) -> int:
        """Append a pass's rows at version `base` and settle the pass (one server-side call)."""
        encoded = await encode_rows(rows)  # a large commit is encoded off the loop
        call = commit_call(pass_id, key, base, rows, encoded, usage, stop_reason, metadata,
                           agent_rows, recorded, born)  # fmt: skip
        # Passes ending at once commit together (one round trip, one server commit), each
        # with its own version check (see treadle.stores.postgres_batch).
        held = self._locks.take(key)  # queue mode: the lock goes back where the commit ends
        if held is None:
            version = await self._batchers()[1](call)
        else:

            async def commit_and_release() -> int:
                # On the runtime's loop, with its batchers: the lock is given back once the
                # commit has ended, whatever becomes of the caller's loop (closed with the
                # commit in flight).
                commits = self._batchers()[1]
                try:
                    await self._check_held(held, key)
                    version = await commits(call)
                    if version < 0:  # a conflict in queue mode: the lock was lost meanwhile?
                        await self._check_held(held, key)
                    return version
                finally:
                    await held.release()

            version = await self._on_runtime(commit_and_release)
        if version < 0:
            raise conflict_error(key, base, -1 - version, rows)
        return version

    async def _check_held(self, held: KeyLock, key: str) -> None:
        """A `StoreError` when the pass's conversation lock was lost (its connection ended):
        another pass may have taken it and run from the same rows, so the pass must not commit
        from what it read, and its failure is no conflict (queue mode promises none)."""
        why = await held.lost() if isinstance(held, PostgresKeyLock) else None
        if why is not None:
            raise StoreError(
                f"the pass lost the lock of conversation {key!r} ({why}): another pass may have "
                "run from the same rows meanwhile, so nothing was written; the pass is kept "
                "resumable (store.pending(key))."
            )

    def commit_soon(
        self,
        then: Callable[[int | BaseException], None],
        pass_id: str,
        key: str,
        base: int,
        rows: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
        agent_rows: Sequence[ChunkRow],
        recorded: bool = True,
        born: float | None = None,
    ) -> None:
        """`commit`, with its outcome (the new version, or the error `commit` would raise)
        handed to `then` on this loop: queued into the batched commits, settled in the one call
        that settles the batch here (`Batcher.submit_then`): no task, no future. Raises at once
        only when the store is closed. Once handed over, the commit runs to its end whatever
        happens to the caller."""
        if self._closed:
            raise StoreError(f"the store {self.url} is closed; open a new Store.")
        kw: dict[str, Any] = {"usage": usage, "stop_reason": stop_reason, "metadata": metadata,
                              "agent_rows": agent_rows, "recorded": recorded,
                              "born": born}  # fmt: skip
        if len(rows) > OFF_LOOP_ROWS:  # its rows are encoded off the loop: a task awaits that
            commit_task(self.commit(pass_id, key, base, rows, **kw), then)
            return
        call = commit_call(pass_id, key, base, rows, rows_text(rows), **kw)

        def settle(outcome: int | BaseException) -> None:
            if isinstance(outcome, int) and outcome < 0:
                then(conflict_error(key, base, -1 - outcome, rows))
            else:
                then(outcome)

        self._batchers()[1].submit_then(call, settle)

    async def append(
        self, key: str, rows: Sequence[ChunkRow], expected: int | None, *, new: bool = False
    ) -> int:
        """Append rows at the end (or only at version `expected`; with `new`, only to a key
        that holds no conversation)."""
        encoded = await encode_rows(rows)  # a large import is encoded off the loop

        async def do(conn: AsyncConnection[Any]) -> int:
            async with committing(conn):
                found = await self._lock(conn, key)
                if new and found is not None:
                    raise exists_error(key, found)
                base = found or 0
                if found is not None:  # a pass waiting for decisions keeps its rows last
                    cur = await conn.execute(
                        "SELECT metadata FROM treadle_conversations WHERE key = %s", (key,)
                    )
                    head = await cur.fetchone()
                    meta = decode_json(head[0], key) if head else None
                    if (expected is None or expected == base) and (
                        refused := waiting_error(key, meta, base)
                    ):
                        raise refused
                if expected is None or expected == base:
                    return await write_rows(conn, key, found, base, encoded, None, {})
            raise conflict_error(key, expected, base, rows)

        held = self._locks.take(key)  # queue mode: the lock goes back where the append ends
        if held is None:
            return await self._run(do)

        async def append_and_release() -> int:
            try:  # on the runtime's loop, whatever becomes of the caller's (see `commit`)
                await self._check_held(held, key)
                return await self._run(do)
            finally:
                await held.release()

        return await self._on_runtime(append_and_release)

    async def pending(self, key: str | None) -> list[PendingPass]:
        """Passes a resume may pick up, oldest first."""

        async def do(conn: AsyncConnection[Any]) -> list[PendingPass]:
            where = "AND p.key = %s" if key is not None else ""
            cur = await conn.execute(
                "SELECT p.pass_id, p.key, p.status, p.version, p.updated_at, p.metadata,"
                f" p.agent_rows, {DB_NOW} FROM treadle_passes p"
                " LEFT JOIN treadle_conversations c"
                " ON c.key = p.key"
                " WHERE p.status IN ('running', 'interrupted', 'cancelled', 'failed')"
                f" AND p.version = coalesce(c.version, 0) {where} ORDER BY p.updated_at",
                (key,) if key is not None else (),
            )
            return pending_list(await cur.fetchall(), key)

        return await self._run(do)

    async def conversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently changed first."""

        async def do(conn: AsyncConnection[Any]) -> list[ConversationInfo]:
            cur = await conn.execute(
                "SELECT key, version, updated_at, parent_key FROM treadle_conversations"
                " ORDER BY updated_at DESC"
            )
            return [ConversationInfo(k, int(v), u, p) for k, v, u, p in await cur.fetchall()]

        return await self._run(do)

    async def fork(self, key: str, new_key: str, version: int | None) -> int:
        """Copy `key` up to `version` to `new_key` (which must be new)."""

        async def do(conn: AsyncConnection[Any]) -> int:
            async with committing(conn):
                at = fork_point(key, await self._lock(conn, key), version)
                if await self._lock(conn, new_key) is not None:
                    raise ConflictError(
                        f"conversation {new_key!r} already exists; fork to a new key.",
                        key=new_key,
                    )
                cur = await conn.execute(
                    "SELECT usage FROM treadle_conversations WHERE key = %s", (key,)
                )
                usage = await cur.fetchone()
                await conn.execute(
                    "INSERT INTO treadle_rows (key, seq, pass_id, kind, payload) SELECT %s, seq,"
                    " pass_id, kind, payload FROM treadle_rows WHERE key = %s AND seq < %s",
                    (new_key, key, at),
                )
                head = {"parent_key": key, "parent_version": at}
                if usage is not None:
                    head["usage"] = usage[0]
                await write_rows(conn, new_key, None, at, (), None, head)
                return at

        return await self._run(do)

    async def delete(self, key: str) -> bool:
        """Delete a conversation with its passes and journal (also a key holding only the
        records of passes that never committed); True when the key held anything."""

        async def do(conn: AsyncConnection[Any]) -> bool:
            async with committing(conn):
                gone = await delete_conversations(conn, [key], None)
            self._cache.drop(key)
            return bool(gone)

        return await self._run(do)

    async def prune(self, before: float) -> int:
        """Delete conversations not changed since `before`, then the records of passes that
        never committed on keys without a conversation, none changed since `before`.

        The age is checked again under each conversation's lock, in the transaction that
        deletes it: one a pass committed to meanwhile is kept. Conversations go in chunks of
        `PRUNE_CHUNK`, each chunk's locks in key order (as batched commits take them), so a
        large prune neither holds more locks than the server's lock table has room for nor
        deadlocks against a batch."""

        async def do(conn: AsyncConnection[Any]) -> int:
            cur = await conn.execute(
                "SELECT key FROM treadle_conversations WHERE updated_at < %s ORDER BY key",
                (before,),
            )
            candidates = [str(k) for (k,) in await cur.fetchall()]
            gone = 0
            for at in range(0, len(candidates), PRUNE_CHUNK):
                async with committing(conn):
                    keys = await delete_conversations(
                        conn, candidates[at : at + PRUNE_CHUNK], before
                    )
                for key in keys:
                    self._cache.drop(key)
                gone += len(keys)
            return gone + await prune_orphans(conn, before)

        return await self._run(do)
