"""A PostgreSQL batch of commits is capped by bytes as well as by passes: passes ending together
whose parameters would pass `BATCH_BYTES` go as several statements, a single commit PostgreSQL
could not take in one message (1 GB) fails alone with `StoreError` before anything is sent, and
a batch of few but large rows is encoded off the event loop.

Real parts: a throwaway PostgreSQL cluster (tests/pg_cluster.py) and a real connection; the
caps are lowered so the sizes stay small (the store reads them at each batch), and
`conn.execute` is wrapped only to see what is sent (it still sends it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pg_cluster import Cluster
from treadle.errors import StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores import Store, postgres_batch
from treadle.stores.batching import encode_rows
from treadle.stores.records import encode_usage


async def _call(key: str, text: str, rows: int = 1) -> tuple[Any, ...]:
    encoded = await encode_rows([ChunkRow.user(f"{text} {i}") for i in range(rows)])
    return (f"pass-{key}", key, 0, [k for k, _ in encoded], [p for _, p in encoded],
            encode_usage(Usage()), "stop", "{}", "done", "[]", False, time.time(),
            None)  # fmt: skip


def _sizes(sent: list[tuple[Any, ...]]) -> list[int]:
    """The bytes of each batch statement's JSON parameter (0 for a commit sent alone)."""
    return [
        len(p[0].data) if len(p) == 1 and isinstance(p[0], postgres_batch.DumpedJson) else 0
        for p in sent
    ]


async def _run(dsn: str, calls: list[tuple[Any, ...]]) -> tuple[list[Any], list[int], bool]:
    """commit_many's results, the sizes of what it sent, and whether the connection survived."""
    import psycopg

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    sent: list[tuple[Any, ...]] = []
    execute = conn.execute

    async def spy(query: Any, params: Any = None, **kw: Any) -> Any:
        sent.append(tuple(params or ()))
        return await execute(query, params, **kw)

    conn.execute = spy  # type: ignore[method-assign]
    try:
        results = await postgres_batch.commit_many(conn, calls)
        conn.execute = execute  # type: ignore[method-assign]
        await conn.execute("SELECT 1")
        return results, _sizes(sent), not conn.broken
    finally:
        await conn.close()


def _database(pg: Cluster) -> str:
    dsn = pg.new_database()
    with Store.postgres(dsn) as store:
        store.append("schema", [])  # creates the schema
    return dsn


def test_a_batch_over_the_byte_cap_goes_as_several_statements(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres_batch, "BATCH_BYTES", 100_000)
    dsn = _database(pg)

    async def main() -> tuple[list[Any], list[int], bool]:
        calls = [await _call(f"k{i}", "é" * 2_000, rows=2) for i in range(12)]
        return await _run(dsn, calls)

    results, sizes, alive = asyncio.run(main())
    assert results == [2] * 12 and alive
    assert 1 < len(sizes) < 12, sizes  # several statements, of several passes ...
    assert all(0 < size <= 100_000 for size in sizes), sizes  # ... each under the cap
    with Store.postgres(dsn) as store:
        for i in range(12):
            assert store.conversation(f"k{i}").rows[1] == ChunkRow.user("é" * 2_000 + " 1")


def test_a_commit_over_the_message_limit_fails_alone(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL breaks a connection sent a message over 1 GB: a commit that would need one
    is refused before it is sent, alone; the other passes of its batch land."""
    monkeypatch.setattr(postgres_batch, "MESSAGE_LIMIT", 100_000)
    monkeypatch.setattr(postgres_batch, "BATCH_BYTES", 50_000)
    dsn = _database(pg)

    async def main() -> tuple[list[Any], list[int], bool]:
        calls = [await _call("a", "small"), await _call("big", "x" * 150_000)]
        calls.append(await _call("c", "small"))
        first = await _run(dsn, calls)
        alone = await _run(dsn, [await _call("big2", "€" * 40_000)])  # 120,000 bytes
        return first[0] + alone[0], first[1] + alone[1], first[2] and alone[2]

    results, sizes, alive = asyncio.run(main())
    assert results[0] == 1 and results[2] == 1 and alive
    for error, key in ((results[1], "big"), (results[3], "big2")):
        assert isinstance(error, StoreError), error
        assert repr(key) in str(error) and "PostgreSQL" in str(error), error
    assert all(size <= 50_000 for size in sizes), sizes
    with Store.postgres(dsn) as store:
        assert {c.key for c in store.conversations()} == {"schema", "a", "c"}


def test_a_batch_of_few_large_rows_is_encoded_off_the_loop(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two passes of one row each, but 2 MB each: the batch's JSON is encoded on a worker
    thread (by bytes, not only by rows)."""
    threads: list[bool] = []  # for each encoding: did an event loop run on its thread?
    real = postgres_batch._batch_json

    def spy(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            threads.append(True)
        except RuntimeError:
            threads.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(postgres_batch, "_batch_json", spy)
    dsn = _database(pg)

    async def main() -> tuple[list[Any], list[int], bool]:
        calls = [await _call(f"k{i}", "y" * 2_000_000) for i in range(2)]
        return await _run(dsn, calls)

    results, _, alive = asyncio.run(main())
    assert results == [1, 1] and alive
    assert threads == [False], threads
