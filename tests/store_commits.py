"""A turn whose commit is cancelled in flight, for both backends' task-free commits: the tests
of each backend (test_stores_sqlite_batch, test_stores_pg_commit) run it and assert the same."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from treadle import Session, arun_session_loop
from treadle.stores import Store
from treadle.stores.journal import inflight
from treadle.testing import ScriptedExecutor

GUARD_SECONDS = 60.0


def cancel_a_commit_in_flight(url: str) -> tuple[list[str], list[str], int, list[str]]:
    """Run turn A, then turn B cancelled while its commit is in flight, on the store at `url`.
    Returns the names of the tasks turn A made, the conversation's contents after both, how
    many commits were in flight at the cancel, and the conversation's pending statuses."""

    async def main() -> tuple[list[str], list[str], int, list[str]]:
        loop = asyncio.get_running_loop()
        names: list[str] = []

        def factory(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
            names.append(getattr(coro, "__name__", ""))
            return asyncio.Task(coro, loop=loop)

        def turn(message: str) -> Any:
            return arun_session_loop(
                Session.from_user_message(message),
                Session.from_agent_prompt("x"),
                executor=ScriptedExecutor([f"answer {message}"]),
                store=store,
                conversation="k",
            )

        async with Store.open(url) as store:
            loop.set_task_factory(factory)
            try:
                await turn("A")
                first = list(names)
                task = asyncio.ensure_future(turn("B"))
                while not inflight(store.backend):  # its commit is on its way
                    await asyncio.sleep(0)
                in_flight = len(inflight(store.backend))
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await asyncio.wait_for(store.asettled(), GUARD_SECONDS)  # a hang guard
            finally:
                loop.set_task_factory(None)
            rows = [str(r.payload.get("content")) for r in (await store.conversation("k")).rows]
            return first, rows, in_flight, [p.status for p in await store.apending("k")]

    return asyncio.run(main())
