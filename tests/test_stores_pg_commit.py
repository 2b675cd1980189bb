"""A PostgreSQL pass's commit without a task of its own: it is queued into the batched commits
with a callback (`PostgresBackend.commit_soon`, `Batcher.submit_then`) that settles the pass on
its own loop when the batch's outcome comes back.

Real parts: a throwaway PostgreSQL cluster (tests/pg_cluster.py), the runtime's loop in its own
thread. Tasks are counted with a task factory that records each coroutine's name.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

from pg_cluster import Cluster
from store_commits import cancel_a_commit_in_flight
from treadle.errors import StoreError
from treadle.stores.batching import Batcher

#: A hang guard, never a timing assertion.
GUARD_SECONDS = 60.0


def test_a_callback_request_is_settled_on_its_callers_loop_with_the_others() -> None:
    """`submit_then` from a loop in another thread: the batch runs on the home loop, each
    callback is called on its caller's loop with its result or its own error; after `close()`
    a request is refused at once and its callback never called."""
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()

    async def run(requests: list[int]) -> list[int | BaseException]:
        return [r * 2 if r != 3 else ValueError("three") for r in requests]

    batcher: Batcher[int, int] = Batcher(run, home=home)

    async def main() -> tuple[list[tuple[int, Any]], bool, list[int]]:
        loop = asyncio.get_running_loop()
        got: list[tuple[int, Any]] = []
        on_loop: list[bool] = []
        done = asyncio.Event()

        def then(i: int, outcome: Any) -> None:
            on_loop.append(asyncio.get_running_loop() is loop)
            got.append((i, outcome))
            if len(got) == 5:
                done.set()

        for i in range(5):
            batcher.submit_then(i, functools.partial(then, i))
        await asyncio.wait_for(done.wait(), GUARD_SECONDS)
        asyncio.run_coroutine_threadsafe(batcher.close(), home).result(GUARD_SECONDS)
        refused = False
        try:
            batcher.submit_then(9, lambda outcome: got.append((9, outcome)))
        except StoreError:
            refused = True
        await asyncio.sleep(0)
        return sorted(got, key=lambda g: g[0]), refused and all(on_loop), [len(got)]

    try:
        got, refused, count = asyncio.run(main())
    finally:
        home.call_soon_threadsafe(home.stop)
        thread.join(GUARD_SECONDS)
        home.close()
    assert [g[1] for g in got if g[0] != 3] == [0, 2, 4, 8]
    assert isinstance(got[3][1], ValueError)
    assert refused and count == [5]


def test_a_postgres_commit_runs_without_a_task_and_is_waited_for(pg: Cluster) -> None:
    """On PostgreSQL a pass's commit is queued into the batched commits and settled by one call
    on the pass's loop: no commit task is made. A pass cancelled while that commit is in flight
    still has it waited for by `asettled`, and the turn lands whole or not at all."""
    dsn = pg.new_database()

    first, rows, in_flight, pending = cancel_a_commit_in_flight(dsn)
    assert "_commit" not in first, first
    assert in_flight == 1
    assert rows[:2] == ["A", "answer A"]
    assert rows[2:] in ([], ["B", "answer B"])  # whole turn or none
    assert pending == ([] if rows[2:] else ["cancelled"])
