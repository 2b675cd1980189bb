"""Batched store work: passes ending together share one commit (each with its own version
check), and the JSON work of a large conversation (50,000 rows) runs off the event loop.

Real parts: a SQLite file, a throwaway PostgreSQL cluster (tests/pg_cluster.py), the fake
OpenAI server over HTTP. The off-loop tests wrap the store's own encode/decode functions with a
spy that still calls them: it notes whether each call ran on an event loop's thread, and holds
the first large call until bystander tickers on the caller's loop and on the runtime's loop
have both ticked, which they can only do if that call is not running on either loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pg_cluster import Cluster, latin1_database
from treadle import Provider, Session, arun_session_loop
from treadle.errors import ConflictError
from treadle.runtime import get_runtime
from treadle.session import ChunkRow
from treadle.stores import Store
from treadle.stores.batching import Batcher
from treadle.testing import FakeOpenAIServer

AGENT = Session.from_agent_prompt("Answer briefly.")
#: A deadlock guard for the spy's wait, never a timing assertion.
GUARD_SECONDS = 120.0
BIG = 50_000


def test_requests_that_queue_while_a_batch_runs_go_together_into_the_next() -> None:
    sizes: list[int] = []

    async def main() -> list[int]:
        gate = asyncio.Event()

        async def run(requests: list[int]) -> list[int | BaseException]:
            sizes.append(len(requests))
            await gate.wait()
            return [r * 2 if r != 7 else ValueError("seven") for r in requests]

        batcher: Batcher[int, int] = Batcher(run, concurrency=1)
        calls = [asyncio.ensure_future(batcher(0))]
        while not sizes:  # the first batch is in flight: the other 19 queue behind it
            await asyncio.sleep(0)
        calls += [asyncio.ensure_future(batcher(i)) for i in range(1, 20)]
        await asyncio.sleep(0)
        gate.set()
        done = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(done[7], ValueError)  # one request's error is its own
        return [d for d in done if isinstance(d, int)]

    results = asyncio.run(main())
    assert sizes == [1, 19]
    assert results == [i * 2 for i in range(20) if i != 7]


def test_callers_on_another_loop_are_served_in_batches_on_the_home_loop() -> None:
    """The PostgreSQL store's reads and commits: callers on their own loop queue requests that
    run in batches on the runtime's loop; a cancelled caller's request still runs."""
    runtime = get_runtime()
    sizes: list[int] = []
    on_home: list[bool] = []
    gate = asyncio.Event()

    async def run(requests: list[int]) -> list[int | BaseException]:
        on_home.append(runtime.in_loop_thread())
        sizes.append(len(requests))
        if len(sizes) == 1:
            await gate.wait()
        return [r * 2 if r != 7 else ValueError("seven") for r in requests]

    batcher: Batcher[int, int] = Batcher(run, concurrency=1, home=runtime.loop)

    async def main() -> list[Any]:
        first = asyncio.ensure_future(batcher(0))
        while not sizes:  # the first batch is in flight on the home loop
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(batcher(i)) for i in range(1, 20)]
        dropped = asyncio.ensure_future(batcher(20))
        await asyncio.sleep(0)  # every call has queued its request
        dropped.cancel()
        runtime.loop.call_soon_threadsafe(gate.set)
        done = await asyncio.gather(first, *rest, return_exceptions=True)
        assert dropped.cancelled()
        return done

    done = asyncio.run(main())
    assert on_home == [True, True]
    assert sizes == [1, 20]  # the cancelled caller's request ran with the others
    assert isinstance(done[7], ValueError)
    assert [d for d in done if isinstance(d, int)] == [i * 2 for i in range(20) if i != 7]


def test_passes_ending_together_keep_their_own_version_checks(url: str) -> None:
    """40 passes at once on 20 conversations, two per conversation from the same version: on
    each conversation exactly one commits, the other is a ConflictError, nothing interleaves."""

    async def main(base_url: str) -> list[Any]:
        provider = Provider(model="fake-model", base_url=base_url, api_key="k")
        async with Store.open(url) as store:
            for i in range(20):
                await store.aappend(f"c{i}", [ChunkRow.user("start")])
            outcomes = await asyncio.gather(
                *(
                    arun_session_loop(
                        Session.from_user_message(f"turn {i} {side}"),
                        AGENT,
                        provider=provider,
                        store=store,
                        conversation=f"c{i}",
                    )
                    for i in range(20)
                    for side in "ab"
                ),
                return_exceptions=True,
            )
            for i in range(20):
                convo = await store.conversation(f"c{i}")
                assert convo.metadata["version"] == 3
                texts = [str(r.content) for r in convo.rows]
                assert texts[0] == "start" and texts[1] in (f"turn {i} a", f"turn {i} b")
                assert texts[2].endswith(texts[1])  # its own reply right after it
            return outcomes

    with FakeOpenAIServer(script="echo") as server:
        outcomes = asyncio.run(main(server.base_url))
    for i in range(20):
        pair = outcomes[2 * i : 2 * i + 2]
        assert sum(isinstance(o, ConflictError) for o in pair) == 1, pair
        assert sum(isinstance(o, Session) for o in pair) == 1, pair


def test_a_commit_that_fails_in_a_batch_fails_alone(pg: Cluster) -> None:
    import psycopg

    from treadle.stores.postgres_batch import commit_many

    dsn = pg.new_database()
    with Store.postgres(dsn) as store:
        store.append("schema", [])  # creates the schema

    def call(pass_id: str, key: str, base: Any) -> tuple[Any, ...]:
        return (pass_id, key, base, ["user"], ['{"content":"hi"}'], "{}", None, "{}", "done",
                "[]", False, time.time(), None)  # fmt: skip

    async def main() -> list[int | BaseException]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return await commit_many(
                conn, [call("p1", "a", 0), call("p2", "b", "not a version"), call("p3", "c", 0)]
            )

    results = asyncio.run(main())
    assert results[0] == 1 and results[2] == 1
    assert isinstance(results[1], psycopg.Error)
    with Store.postgres(dsn) as store:
        assert {i.key: i.version for i in store.conversations()} == {"a": 1, "c": 1, "schema": 0}


class _Spy:
    """Wraps a store function: notes where each call runs, holds the first one until both
    bystander tickers ticked (possible only while the call is off both loops)."""

    def __init__(self, fn: Callable[..., Any], ticks: list[int]) -> None:
        self.fn, self.ticks = fn, ticks
        self.calls = 0
        self.on_loop = 0
        self.ticked_during: bool | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
            first = self.ticked_during is None
            if first:
                self.ticked_during = False
        try:
            asyncio.get_running_loop()
            self.on_loop += 1
        except RuntimeError:  # no loop runs on this thread: off the loop
            if first:
                seen = list(self.ticks)
                deadline = time.monotonic() + GUARD_SECONDS
                while not all(now > then for now, then in zip(self.ticks, seen, strict=True)):
                    if time.monotonic() > deadline:
                        return self.fn(*args, **kwargs)  # ticked_during stays False
                    time.sleep(0.001)
                self.ticked_during = True
        return self.fn(*args, **kwargs)


async def _ticker(ticks: list[int], slot: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        ticks[slot] += 1
        await asyncio.sleep(0.001)


def _big_rows() -> list[ChunkRow]:
    return [
        ChunkRow.user(f"row {i}") if i % 2 == 0 else ChunkRow("assistant", {"content": f"a{i}"})
        for i in range(BIG)
    ]


@pytest.mark.slow  # 50,000 rows written, read, exported and imported: several seconds
def test_a_large_conversation_is_encoded_and_decoded_off_the_loop(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from treadle.persist.format import encode_row
    from treadle.stores.records import decode_row, rows_text

    ticks = [0, 0]  # the caller's loop, the runtime's loop
    encode = _Spy(rows_text, ticks)
    decode = _Spy(decode_row, ticks)
    export = _Spy(encode_row, ticks)
    for where in ("treadle.stores.batching", "treadle.stores.sqlite_writes"):
        monkeypatch.setattr(f"{where}.rows_text", encode)
    for where in ("treadle.stores.batching", "treadle.stores.sqlite"):
        monkeypatch.setattr(f"{where}.decode_row", decode)
    monkeypatch.setattr("treadle.stores.postgres_batch.decode_row", decode)  # batched reads
    monkeypatch.setattr("treadle.stores.transfer.encode_row", export)

    async def main() -> None:
        stop = asyncio.Event()
        runtime_stop = threading.Event()

        async def runtime_ticker() -> None:
            while not runtime_stop.is_set():
                ticks[1] += 1
                await asyncio.sleep(0.001)

        here = asyncio.ensure_future(_ticker(ticks, 0, stop))
        there = get_runtime().submit(runtime_ticker())
        try:
            async with Store.open(url) as store:
                await store.aappend("big", _big_rows())  # the rows encoded
                assert encode.ticked_during and encode.on_loop == 0
                other = Store.open(url)  # a fresh cache: every row is decoded
                try:
                    assert (await other.conversation("big")).metadata["version"] == BIG
                finally:
                    await other.aclose()
                assert decode.ticked_during and decode.on_loop == 0
                await store.aexport_jsonl("big", tmp_path / "big.jsonl")
                assert export.ticked_during and export.on_loop == 0
                encode.ticked_during = None  # the import writes the rows again
                assert await store.aimport_jsonl(tmp_path / "big.jsonl", key="copy") == (
                    "copy",
                    BIG,
                )
                assert encode.ticked_during and encode.on_loop == 0
        finally:
            stop.set()
            runtime_stop.set()
            await here
            await there.wait()

    asyncio.run(main())


def test_many_ordinary_conversations_in_one_batch_are_handled_off_the_loop(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each conversation is under the off-loop threshold, the batch is over it: its rows are
    decoded, and a batch of commits' JSON parameter encoded, on a worker thread. Calls the
    batch functions on one real connection, so the batch is exactly these conversations."""
    import psycopg

    from treadle.session import Usage
    from treadle.stores import postgres_batch
    from treadle.stores.batching import OFF_LOOP_ROWS, encode_rows
    from treadle.stores.records import RowCache, decode_row, encode_usage

    per, count = OFF_LOOP_ROWS // 2, 4  # 256 rows each, 1,024 in all
    dsn = pg.new_database()
    ticks = [0, 0]  # this loop; the second slot is not used here: count it as ticking
    decode = _Spy(decode_row, ticks)
    arrays = _Spy(postgres_batch._batch_json, ticks)
    monkeypatch.setattr(postgres_batch, "decode_row", decode)
    monkeypatch.setattr(postgres_batch, "_batch_json", arrays)

    async def main() -> None:
        keys = [f"c{i}" for i in range(count)]
        async with Store.postgres(dsn) as store:
            for key in keys:
                await store.aappend(key, [ChunkRow.user(f"{key} {i}") for i in range(per)])
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks[0] += 1
                ticks[1] += 1
                await asyncio.sleep(0.001)

        here = asyncio.ensure_future(ticker())
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            loaded = await postgres_batch.load_many(conn, keys, RowCache())
            assert [c.version for c in loaded] == [per] * count
            assert decode.ticked_during and decode.on_loop == 0
            calls = []
            for key in keys:
                encoded = await encode_rows([ChunkRow.user("more")] * per)
                calls.append(
                    (
                        f"pass-{key}",
                        key,
                        per,
                        [k for k, _ in encoded],
                        [p for _, p in encoded],
                        encode_usage(Usage()),
                        "stop",
                        "{}",
                        "done",
                        "[]",
                        False,
                        time.time(),
                        None,
                    )
                )
            sent: list[tuple[Any, ...]] = []
            execute = conn.execute

            async def spy_execute(query: Any, params: Any = None, **kw: Any) -> Any:
                sent.append(tuple(params or ()))
                return await execute(query, params, **kw)

            conn.execute = spy_execute  # type: ignore[method-assign]
            assert await postgres_batch.commit_many(conn, calls) == [2 * per] * count
            assert arrays.ticked_during and arrays.on_loop == 0
            # The batch's parameter reached psycopg already encoded (off the loop too), and
            # what it carried is what a read gives back.
            assert len(sent[0]) == 1 and isinstance(sent[0][0], postgres_batch.DumpedJson)
            conn.execute = execute  # type: ignore[method-assign]
            again = await postgres_batch.load_many(conn, keys, RowCache())
            assert [len(c.rows) for c in again] == [2 * per] * count
            assert again[0].rows[per:] == (ChunkRow.user("more"),) * per
        finally:
            await conn.close()
            stop.set()
            await here

    asyncio.run(main())


def test_a_batch_parameter_carries_any_text_as_a_list_would(pg: Cluster) -> None:
    """The JSON made off the loop holds quotes, backslashes, braces, NUL-free Unicode and empty
    strings exactly as psycopg's own conversion of the list does, made `text[]` again as the
    batched commit makes a pass's payloads."""
    import psycopg

    from treadle.stores import postgres_batch

    items = ['{"a": "q\\"uote"}', "", "back\\slash", "{brace}", "é 漢 🙂", "NULL", "x" * 5000]
    call = ("p", "k", 0, ["user"] * len(items), items, "{}", None, "{}", "done", "", False, 1.5,
            None)  # fmt: skip

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(pg.new_database(), autocommit=True)
        try:
            conn.adapters.register_dumper(
                postgres_batch.DumpedJson, postgres_batch._dumped_dumper()
            )
            param = postgres_batch._batch_json([call])
            assert isinstance(param, postgres_batch.DumpedJson)
            cur = await conn.execute(
                "SELECT ARRAY(SELECT e FROM json_array_elements_text((%b::json) -> 0 -> 'payloads')"
                " WITH ORDINALITY AS p(e, o) ORDER BY o), %b::text[]",
                (param, items),
            )
            found = await cur.fetchone()
            assert found is not None and found[0] == items == found[1]
        finally:
            await conn.close()

    asyncio.run(main())


@pytest.mark.parametrize("where", ["latin1-database", "PGCLIENTENCODING", "dsn-options"])
def test_a_large_group_commit_keeps_text_whatever_the_client_encoding(
    pg: Cluster, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A batch over the off-loop threshold hands psycopg its rows already dumped as UTF-8: the
    store's own connections speak UTF8 whatever the database, the environment or the DSN say,
    and a connection that speaks another encoding gets its arrays converted by psycopg. Either
    way the rows read back as written (they once came back as mojibake, "cafÃ©")."""
    import psycopg

    from treadle.session import Usage
    from treadle.stores import postgres_batch
    from treadle.stores.batching import OFF_LOOP_ROWS, encode_rows
    from treadle.stores.records import encode_usage

    text = "café 漢 🙂"
    if where == "latin1-database":
        dsn, text = latin1_database(pg), "café"  # all LATIN1 can hold
    elif where == "PGCLIENTENCODING":
        dsn = pg.new_database()
        monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")
    else:
        dsn = pg.new_database() + "&options=-c%20client_encoding%3DLATIN1"
    per = OFF_LOOP_ROWS // 2 + 1  # two conversations: over the threshold together

    async def calls(keys: list[str], base: int, text: str) -> list[tuple[Any, ...]]:
        out = []
        for key in keys:
            encoded = await encode_rows([ChunkRow.user(f"{text} {i}") for i in range(per)])
            out.append(
                (f"pass-{key}-{base}", key, base, [k for k, _ in encoded],
                 [p for _, p in encoded], encode_usage(Usage()), "stop", "{}", "done", "[]",
                 False, time.time(), None)
            )  # fmt: skip
        return out

    async def main() -> None:
        keys = ["a", "b"]
        async with Store.postgres(dsn) as store:
            backend: Any = store.backend
            for key in keys:
                await store.aappend(key, [ChunkRow.user(text)])

            async def encoding(conn: Any) -> str:
                return str(conn.info.encoding)

            assert await backend._run(encoding) == "utf-8"
            # Through the store's own connection ...
            batch = await calls(keys, 1, text)
            done = await backend._run(lambda conn: postgres_batch.commit_many(conn, batch))
            assert done == [1 + per] * 2
            # ... and through one that speaks LATIN1 as the environment or the DSN says.
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                assert conn.info.encoding == "iso8859-1"
                batch = await calls(keys, 1 + per, "café")
                assert await postgres_batch.commit_many(conn, batch) == [1 + 2 * per] * 2
            written = [
                ChunkRow.user(text),
                *(ChunkRow.user(f"{text} {i}") for i in range(per)),
                *(ChunkRow.user(f"café {i}") for i in range(per)),
            ]
            for key in keys:
                assert list((await backend.load(key)).rows) == written

    asyncio.run(main())
